"""Days 13-21's fast paths against their oracles on each device: the CPU always, CUDA with
`-m gpu` where there is one (`bash .ci/gpu` runs them there).

The CPU runs of these tests repeat, on small models, what each day's own tests check in more
depth; they are here so that the GPU runs are the same code, already run. Per device: the
serving engine (the paged cache, the scheduler, the runner's plain road off the CPU) against
batch-1 generate(); left-padded batched generation (day 13) against batch-1; the quantized
step (day 15, int8 and int4) against the quantized model's uncached forward; speculative
greedy decoding against greedy generate(); a grammar's mask
on the device's logits; grouped expert dispatch against the per-token loop and a MoE
model's cached generation against its uncached forward (day 20); the absorbed
latent-attention decode against the uncached model, and a sliding window's cached generation
against its uncached forward (day 21); the HTTP server
(`serve --device`) against generate(). Float32 results are
judged against float64 runs (tinygpt.testing.check_float32_error): at most FACTOR times as
far as the oracle's own float32 run, plus FLOOR. Measured on the CPU (AMD EPYC with AVX-512,
2026-11-28): grouped dispatch 3.7e-7 from float64 against the loop's 1.4e-7; the absorbed decode
1.0e-7 against the uncached model's 1.1e-7; a wrong expert, slot or head is off by 0.01 to 1.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from tests.test_kv_cache import ids_for, make_model
from tinygpt import moe as M
from tinygpt.engine import Engine
from tinygpt.generate import generate
from tinygpt.kv_cache import DecodeStep, KVCache, prefill
from tinygpt.model import ModelConfig, TinyGPT
from tinygpt.sampling import SamplingParams
from tinygpt.speculative import PromptLookupDrafter, speculative_generate
from tinygpt.testing import check_float32_error

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
FACTOR, FLOOR = 4.0, 1e-6
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12)


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("CUDA is not available: the GPU runs of days 13-21 need a GPU")
    return torch.device(request.param)


def dense_model(device: torch.device, **changes) -> TinyGPT:
    return make_model(max_seq_len=96, **changes).to(device)


def ids(n: int, seed: int) -> list[int]:
    return ids_for(1, n, seed)[0].tolist()


def test_engine_equals_batch_one_generate(device):
    model = dense_model(device)
    prompts = [ids(n, seed=n) for n in (3, 17, 9, 30, 1)]
    engine = Engine(model, block_size=8, max_running=3, token_budget=20)
    assert engine.runner.batched == (device.type == "cpu"), engine.runner.batched_reason
    got = [r.token_ids for r in engine.generate(prompts, GREEDY)]
    assert engine.steps > 0 and engine.cache.k.device.type == device.type
    assert got == [generate(model, p, GREEDY).token_ids for p in prompts]


def test_speculative_greedy_equals_generate(device):
    model = dense_model(device)
    prompt = ids(8, seed=2) * 3                       # repeats for prompt lookup to find
    params = SamplingParams(temperature=0.0, max_new_tokens=20)
    got = speculative_generate(model, PromptLookupDrafter(), prompt, params, gamma=4)
    assert got.token_ids == generate(model, prompt, params).token_ids


def test_a_grammar_masks_the_devices_logits(device):
    """The course's shipped model and tokenizer under a JSON schema (llguidance): the reply
    parses and validates (the mask is built on the host, applied to the device's logits)."""
    pytest.importorskip("llguidance")
    from tinygpt.structured import Grammars
    from tinygpt.train import load_pretrained

    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                     "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    model, tokenizer = load_pretrained(device)
    eos = tokenizer.special_tokens["<|endoftext|>"]
    constraint = Grammars(tokenizer, model.cfg.vocab_size).json_schema(schema).constraint([eos])
    out = generate(model.eval(), tokenizer.encode("Once upon a time"),
                   SamplingParams(temperature=0.0, max_new_tokens=24), eos_id=eos,
                   tokenizer=tokenizer, constraint=constraint)
    reply = json.loads(out.text)
    assert set(reply) == {"n"} and 0 <= reply["n"] <= 9, out.text
    assert out.stop_reason != "length", out.text


def test_grouped_dispatch_equals_the_loop(device):
    g = torch.Generator().manual_seed(0)
    n, d, e, k, i = 37, 48, 8, 3, 40
    x = torch.randn(n, d, generator=g)
    logits = x @ (0.5 * torch.randn(e, d, generator=g)).T
    weights, experts = M.route_softmax_topk(logits, k)
    w1, w3, w2 = (0.1 * torch.randn(shape, generator=g) for shape in ((e, i, d), (e, i, d),
                                                                      (e, d, i)))
    on = [t.to(device) for t in (x, weights, experts, w1, w3, w2)]
    got = M.dispatch(*on).cpu()
    loop = M.moe_loop(*on).cpu()
    truth = M.moe_loop(x.double(), weights.double(), experts, w1.double(), w3.double(),
                       w2.double())
    check_float32_error(f"grouped dispatch on {device}", got, loop, truth, factor=FACTOR,
                        floor=FLOOR)


def test_absorbed_latent_decode_equals_the_uncached_model(device):
    cfg = ModelConfig(vocab_size=61, d_model=64, n_layers=2, n_heads=4, n_kv_heads=4,
                      d_ff=96, max_seq_len=64, attention="mla", kv_lora_rank=32,
                      qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)
    model = TinyGPT(cfg, seed=1).eval()
    twin = copy.deepcopy(model).double()
    model = model.to(device)
    tokens = torch.tensor([ids(12, seed=4), ids(12, seed=5)])
    with torch.no_grad():
        full = model(tokens.to(device))[:, 4:11].cpu()
        truth = twin(tokens)[:, 4:11]
        cache = KVCache.for_model(model, 2, 20)
        logits = [prefill(model, cache, tokens[:, :5].to(device))]
        step = DecodeStep(model, cache)
        logits += [step(tokens[:, t:t + 1].to(device)) for t in range(5, 11)]
    assert all(layer.attention.decode == "absorbed" for layer in model.layers)
    check_float32_error(f"absorbed decode on {device}", torch.stack(logits, 1).cpu(), full,
                        truth, factor=FACTOR, floor=FLOOR)


@pytest.mark.slow
def test_the_server_on_the_device_answers_as_generate_does(device):
    """`python -m tinygpt serve --device D`: a greedy completion and a streamed chat reply
    through HTTP equal batch-1 generate() on the same device."""
    import httpx

    from tinygpt.bench.load import running_server
    from tinygpt.train import load_pretrained

    model, tokenizer = load_pretrained(device)
    eos = tokenizer.special_tokens["<|endoftext|>"]
    want = generate(model.eval(), tokenizer.encode("The cat sat on the"),
                    SamplingParams(temperature=0.0, max_new_tokens=16), eos_id=eos,
                    tokenizer=tokenizer)
    with running_server("--device", str(device), "--threads", "1") as (url, _):
        reply = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "model": "tinygpt", "prompt": "The cat sat on the", "max_tokens": 16,
            "temperature": 0}).json()
    assert reply["choices"][0]["text"] == want.text
    assert reply["usage"]["completion_tokens"] == len(want.token_ids)


def test_serve_refuses_a_device_it_cannot_use(capsys):
    from tinygpt.server.cli import main

    assert main(["--device", "tpu"]) == 2
    assert "--device: device must be one of" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["--device", "cuda"]) == 2
        assert "--device cuda: CUDA is not available here" in capsys.readouterr().err
    else:
        assert main(["--device", "cuda", "--quantize", "int8"]) == 2
        assert "--quantize and --tensor-parallel-size > 1 are for the CPU" in \
            capsys.readouterr().err


def test_batched_generation_equals_batch_one(device):
    from tinygpt.batching import generate_batch

    model = dense_model(device)
    prompts = [ids(n, seed=10 + n) for n in (5, 1, 12, 7)]
    got = [r.token_ids for r in generate_batch(model, prompts, GREEDY)]
    assert got == [generate(model, p, GREEDY).token_ids for p in prompts]


@pytest.mark.parametrize("scheme", ["int8", "int4-g32"])
def test_the_quantized_step_gives_the_quantized_models_tokens(device, scheme):
    """Day 15: generate() on a quantized model (QuantizedDecodeStep, the fused step) against
    the quantized model's own forward over the whole context each step (use_cache=False)."""
    from tinygpt.quant import quantize_model

    model = quantize_model(dense_model(device, d_model=64, d_ff=128), scheme)
    prompt = ids(9, seed=3)
    cached = generate(model, prompt, GREEDY)
    assert cached.token_ids == generate(model, prompt, GREEDY, use_cache=False).token_ids


@pytest.mark.parametrize("kind", ["moe", "window"])
def test_cached_generation_of_moe_and_windowed_models(device, kind):
    """Day 20's MoE decode step (the chosen experts only) and day 21's sliding window (its
    cache reads the last W positions) against the uncached forward, 40 tokens past a window
    of 8."""
    extra = dict(n_experts=8, top_k=2, d_expert=24) if kind == "moe" else \
        dict(sliding_window=8, full_attention_layers=(1,))
    model = dense_model(device, **extra)
    prompt = ids(6, seed=8)
    params = SamplingParams(temperature=0.0, max_new_tokens=40)
    assert generate(model, prompt, params).token_ids == \
        generate(model, prompt, params, use_cache=False).token_ids
