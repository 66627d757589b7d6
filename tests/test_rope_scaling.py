"""Day 21: RoPE scaling (tinygpt.positions, ModelConfig.rope_scaling, tinygpt.hf_rope).

The inverse frequencies and YaRN's attention factor of "linear", "dynamic", "yarn" and
"llama3" against transformers' ROPE_INIT_FUNCTIONS for several configs each (bit for bit: the
same float32 operations), what each does to the channels, the config's validation and JSON
round trip, and random Hugging Face Llama models with each scaling against
LlamaForCausalLM: logits, greedy tokens (transformers' generate against ours, cached), also
from a folder through load_model.

Tolerance of the logits: ours may be at most FACTOR times as far from transformers' model run
in float64 as transformers' float32 run is, plus FLOOR (tinygpt.testing.check_float32_error).
Both runs share the float32 RoPE tables (transformers computes them in float32 even for a
float64 model, and ours are equal bit for bit), so what differs is the order of the sums.
Measured on the 2-core AMD EPYC with AVX-512 (2026-11-27), 5 weight draws per scaling (logits up to
0.7, errors 1.6e-7 to 3.6e-7): ours over theirs 1.00 for linear, yarn and llama3 (the same float32
sums) and at most 1.21 for dynamic. FACTOR = 4 as in tests/test_moe_hf.py; the same weights
without the scaling are checked to land more than 100 times the error away (0.04 for dynamic).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math

import pytest
import torch

from tinygpt.generate import generate
from tinygpt.model import ModelConfig, TinyGPT
from tinygpt.positions import (
    ROPE_TYPES,
    check_rope_scaling,
    rope_cos_sin,
    rope_inv_freq,
    rope_scaled_inv_freq,
    scaled_rope_cos_sin,
    yarn_attention_factor,
)
from tinygpt.sampling import SamplingParams
from tinygpt.testing import check_float32_error

FACTOR, FLOOR = 4.0, 1e-7

SCALINGS = [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "linear", "factor": 2},
    {"rope_type": "dynamic", "factor": 2.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096,
     "beta_fast": 16, "beta_slow": 2},
    {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
     "mscale": 1.0, "mscale_all_dim": 0.707},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768,
     "truncate": False},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
    {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
]
HEADS = [(16, 10000.0, 256), (64, 500000.0, 131072), (128, 1e6, 32768)]


def _hf_init(scaling: dict, head_dim: int, theta: float, context: int, seq_len=None):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {k: v for k, v in scaling.items()}
    config = transformers.LlamaConfig(hidden_size=2 * head_dim, num_attention_heads=2,
                                      head_dim=head_dim, max_position_embeddings=context,
                                      rope_parameters={**params, "rope_theta": theta})
    return ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config, "cpu", seq_len=seq_len)


def _ours(scaling: dict, context: int) -> dict:
    """Our scaling of a transformers one: dynamic's original length is ours to record."""
    if scaling["rope_type"] == "dynamic":
        return {**scaling, "original_max_position_embeddings": context}
    return scaling


@pytest.mark.parametrize("head_dim,theta,context", HEADS)
@pytest.mark.parametrize("scaling", SCALINGS, ids=lambda s: "-".join(map(str, s.values())))
def test_inverse_frequencies_equal_transformers_bit_for_bit(scaling, head_dim, theta, context):
    for seq_len in ([None, 3 * context] if scaling["rope_type"] == "dynamic" else [None]):
        want, want_factor = _hf_init(scaling, head_dim, theta, context, seq_len)
        got, got_factor = rope_scaled_inv_freq(head_dim, theta, _ours(scaling, context),
                                               seq_len=seq_len)
        assert got.dtype == torch.float32 and torch.equal(got, want), (scaling, seq_len)
        assert got_factor == want_factor
        # the float64 formulas: within a few float32 steps of both (measured: 3e-7 at most)
        exact, _ = rope_scaled_inv_freq(head_dim, theta, _ours(scaling, context),
                                        seq_len=seq_len, dtype=torch.float64)
        assert ((got.double() - exact) / exact).abs().max() < 8 * torch.finfo(torch.float32).eps


def test_what_each_scaling_does_to_the_channels():
    head_dim, base = 64, 10000.0
    plain = rope_inv_freq(head_dim, base, dtype=torch.float64)
    wavelen = 2 * math.pi / plain
    # linear: every channel divided by the factor
    linear, _ = rope_scaled_inv_freq(head_dim, base, {"rope_type": "linear", "factor": 4.0},
                                     dtype=torch.float64)
    torch.testing.assert_close(linear, plain / 4, rtol=1e-15, atol=0)
    # llama3: short wavelengths kept, long ones divided, the middle strictly between
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 2048}
    got, _ = rope_scaled_inv_freq(head_dim, base, llama3, dtype=torch.float64)
    short, long = wavelen < 2048 / 4, wavelen > 2048
    middle = ~short & ~long
    assert short.any() and long.any() and middle.any()
    assert torch.equal(got[short], plain[short])
    torch.testing.assert_close(got[long], plain[long] / 8, rtol=1e-15, atol=0)
    assert ((got[middle] < plain[middle]) & (got[middle] > plain[middle] / 8)).all()
    # yarn: fast channels (> beta_fast turns in the original context) kept, slow (< beta_slow)
    # divided, and cos / sin multiplied by 0.1 ln(factor) + 1
    yarn = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 2048}
    got, attention = rope_scaled_inv_freq(head_dim, base, yarn, dtype=torch.float64)
    turns = 2048 / wavelen
    assert torch.equal(got[turns > 64], plain[turns > 64])
    torch.testing.assert_close(got[turns < 0.5], plain[turns < 0.5] / 16, rtol=1e-15, atol=0)
    assert attention == pytest.approx(0.1 * math.log(16) + 1)
    cos, sin = scaled_rope_cos_sin(head_dim, torch.tensor([0, 5]), base, yarn,
                                   dtype=torch.float64)
    assert torch.allclose(cos[0], torch.full((head_dim,), attention, dtype=torch.float64))
    torch.testing.assert_close(cos ** 2 + sin ** 2, torch.full_like(cos, attention ** 2))
    assert yarn_attention_factor(0.5) == 1.0
    # dynamic: plain up to the original length, then a larger base (longer wavelengths), the
    # fastest channel untouched
    dynamic = {"rope_type": "dynamic", "factor": 4.0, "original_max_position_embeddings": 100}
    assert torch.equal(rope_scaled_inv_freq(head_dim, base, dynamic, seq_len=100)[0],
                       rope_inv_freq(head_dim, base))
    grown, _ = rope_scaled_inv_freq(head_dim, base, dynamic, seq_len=400, dtype=torch.float64)
    assert grown[0] == plain[0] and (grown[1:] < plain[1:]).all()
    # no scaling: rope_cos_sin's tables exactly
    for scaling in (None, (), {"rope_type": "default"}):
        for a, b in zip(scaled_rope_cos_sin(16, 40, 500.0, scaling), rope_cos_sin(16, 40, 500.0),
                        strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("scaling,match", [
    ({"rope_type": "longrope", "factor": 2.0}, "rope_type.*one of"),
    ({"factor": 2.0}, "rope_type.*one of"),
    ({"rope_type": "linear"}, "'linear' needs the keys \\('factor',\\).*missing \\['factor'\\]"),
    ({"rope_type": "linear", "factor": 2.0, "beta_fast": 3}, "unexpected \\['beta_fast'\\]"),
    ({"rope_type": "linear", "factor": 0.0}, "factor must be a finite number > 0"),
    ({"rope_type": "linear", "factor": True}, "factor must be a finite number"),
    ({"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 1.5},
     "original_max_position_embeddings must be a positive integer"),
    ({"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 8,
      "truncate": 1}, "truncate must be True or False"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
      "original_max_position_embeddings": 8}, "high_freq_factor .* must be > low_freq_factor"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": None, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8}, "low_freq_factor must be a finite number > 0.0, "
                                              "got None"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": None,
      "original_max_position_embeddings": 8}, "high_freq_factor must be a finite number > 0.0, "
                                              "got None"),
    ("linear", "mapping or \\(key, value\\) pairs"),
])
def test_bad_scalings_are_named(scaling, match):
    with pytest.raises(ValueError, match=match):
        check_rope_scaling(scaling)
    with pytest.raises(ValueError, match=match):
        ModelConfig(vocab_size=8, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=8,
                    max_seq_len=8, rope_scaling=scaling)
    assert ROPE_TYPES == ("default", "linear", "dynamic", "yarn", "llama3")


def test_dynamic_scaling_needs_heads_of_at_least_4():
    """Dynamic's base grows as a power head_dim / (head_dim - 2): 2-wide heads are refused."""
    dynamic = {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 8}
    with pytest.raises(ValueError, match="head_dim must be >= 4 with 'dynamic' RoPE scaling, "
                                         "got 2"):
        ModelConfig(vocab_size=8, d_model=8, n_layers=1, n_heads=4, n_kv_heads=1, d_ff=8,
                    max_seq_len=16, rope_scaling=dynamic)
    with pytest.raises(ValueError, match="head_dim must be >= 4 with 'dynamic' scaling, got 2"):
        rope_scaled_inv_freq(2, 10000.0, dynamic, seq_len=16)
    cfg = ModelConfig(vocab_size=8, d_model=8, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=8,
                      max_seq_len=16, rope_scaling=dynamic)
    assert cfg.head_dim == 4 and TinyGPT(cfg)(torch.zeros(1, 12, dtype=torch.long)).isfinite().all()


def test_the_config_stores_sorted_pairs_and_round_trips_through_json():
    base = dict(vocab_size=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48,
                max_seq_len=64)
    plain = ModelConfig(**base)
    assert plain.rope_scaling == () and plain.rope_type == "default"
    assert ModelConfig(**base, rope_scaling={"rope_type": "default"}) == plain
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    cfg = ModelConfig(**base, rope_scaling=llama3)
    assert cfg.rope_scaling == tuple(sorted(llama3.items())) and cfg.rope_type == "llama3"
    assert ModelConfig(**base, rope_scaling=tuple(reversed(cfg.rope_scaling))) == cfg
    assert hash(cfg) != hash(plain) and "rope_scaling" in repr(cfg)
    assert "rope_scaling" not in repr(plain)
    # train.save_checkpoint writes dataclasses.asdict(cfg) as JSON: lists come back
    back = ModelConfig(**json.loads(json.dumps(dataclasses.asdict(cfg))))
    assert back == cfg
    # a checkpoint written before day 21 has no such keys and loads as plain RoPE
    old = {k: v for k, v in dataclasses.asdict(plain).items()
           if k not in ("rope_scaling", "sliding_window", "full_attention_layers")}
    assert ModelConfig(**old) == plain
    # a static scaling is only the tables: the fast paths stay open; dynamic closes them
    assert cfg.fast_path_refusal() is None
    dynamic = ModelConfig(**base, rope_scaling={"rope_type": "dynamic", "factor": 2.0,
                                                "original_max_position_embeddings": 32})
    assert "dynamic" in dynamic.fast_path_refusal()


def test_the_model_uses_the_scaled_tables_and_dynamic_grows_past_its_original_length():
    base = dict(vocab_size=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48,
                max_seq_len=64)
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    model = TinyGPT(ModelConfig(**base, rope_scaling=yarn))
    cos, sin = scaled_rope_cos_sin(8, 64, 10000.0, yarn)
    assert torch.equal(model.rope_cos, cos) and torch.equal(model.rope_sin, sin)
    # dynamic: within the original 16 positions the plain model; past them not, and a pass
    # of 40 tokens uses the base of length 40 for all of them
    dyn = {"rope_type": "dynamic", "factor": 4.0, "original_max_position_embeddings": 16}
    model = TinyGPT(ModelConfig(**base, rope_scaling=dyn)).eval()
    plain = TinyGPT(ModelConfig(**base)).eval()
    ids = torch.randint(0, 32, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(ids[:, :16]), plain(ids[:, :16]))
        got = model(ids)
        assert (got - plain(ids)).abs().max() > 1e-4
        twin = copy.deepcopy(model)
        cos, sin = scaled_rope_cos_sin(8, 64, 10000.0, dyn, seq_len=40)
        twin.rope_cos, twin.rope_sin = cos, sin
        twin.cfg = dataclasses.replace(model.cfg, rope_scaling=())
        torch.testing.assert_close(got, twin(ids), rtol=0, atol=0)


# --------------------------------------------------------------------------------------------
# Hugging Face Llama folders with each scaling


HF_CASES = {
    "linear": (64, 10000.0, {"rope_type": "linear", "factor": 4.0}),
    "dynamic": (32, 10000.0, {"rope_type": "dynamic", "factor": 2.0}),
    "yarn": (256, 100.0, {"rope_type": "yarn", "factor": 4.0,
                          "original_max_position_embeddings": 64}),
    "llama3": (256, 100.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
}
VOCAB = 48


def hf_llama(name: str, seed: int = 0):
    transformers = pytest.importorskip("transformers")
    context, theta, scaling = HF_CASES[name]
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context,
        rope_parameters={**scaling, "rope_theta": theta}, rms_norm_eps=1e-6,
        attn_implementation="eager", bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).eval()


def word_tokenizer():
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    core = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=core, unk_token="w0")


@pytest.mark.parametrize("name", sorted(HF_CASES))
def test_scaled_llama_gives_transformers_logits_and_greedy_tokens(tmp_path, name):
    from tinygpt.hf_models import config_from_hf, config_to_hf, from_hf, to_hf_llama
    from tinygpt.loading import load_model

    hf = hf_llama(name)
    fresh = copy.deepcopy(hf)             # dynamic's rotary keeps state: generate from a new one
    cfg = config_from_hf(hf.config)
    assert cfg.rope_type == name
    ours = from_hf(hf, hf.config)
    ids = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = hf(ids).logits, ours(ids)
        truth = copy.deepcopy(fresh).double()(ids).logits
    err, ref_err = check_float32_error(f"TinyGPT from a Llama with {name} RoPE", got, want, truth,
                                       factor=FACTOR, floor=FLOOR)
    # the same model without the scaling is far off: the check can fail
    plain = from_hf(hf, {**hf.config.to_dict(), "max_position_embeddings": cfg.max_seq_len,
                         "rope_parameters": {"rope_type": "default",
                                             "rope_theta": HF_CASES[name][1]}})
    with torch.no_grad():
        assert (plain(ids) - want).abs().max() > 100 * (err + FLOOR)
    # greedy tokens: transformers' generate (its cache) against ours, from a folder
    fresh.save_pretrained(tmp_path, safe_serialization=True)
    word_tokenizer().save_pretrained(tmp_path)
    model, _, info = load_model(tmp_path)
    assert model.cfg == cfg and info.context_length == cfg.max_seq_len
    prompt = ids[0, :40].tolist()
    with torch.no_grad():
        out = fresh.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, 40).long(),
                             max_new_tokens=12, min_new_tokens=12, do_sample=False,
                             eos_token_id=None, pad_token_id=0)      # token 0 is no pad
    params = SamplingParams(temperature=0, max_new_tokens=12)
    assert generate(model, prompt, params).token_ids == out[0, 40:].tolist()
    # and back: config_to_hf writes the same rope_parameters (dynamic: its original length
    # as transformers' max_position_embeddings), and to_hf_llama's model gives the logits
    back = config_to_hf(cfg)
    assert back.max_position_embeddings == HF_CASES[name][0] and config_from_hf(back) == cfg
    with torch.no_grad():
        torch.testing.assert_close(to_hf_llama(ours, "eager")(ids).logits, want, rtol=0, atol=0)


def test_rope_types_we_do_not_implement_are_refused():
    from tinygpt.hf_models import config_from_hf

    base = dict(model_type="llama", vocab_size=41, hidden_size=32, intermediate_size=56,
                num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=32)
    with pytest.raises(ValueError, match="'longrope' is not supported.*rope_type in"):
        config_from_hf({**base, "rope_scaling": {"type": "longrope", "long_factor": [1.0]}})
    # an older config.json's rope_scaling with "type", yarn's original length from the top
    cfg = config_from_hf({**base, "original_max_position_embeddings": 8, "rope_scaling": {
        "type": "yarn", "factor": 4.0, "beta_fast": None}})
    assert dict(cfg.rope_scaling) == {"rope_type": "yarn", "factor": 4.0,
                                      "original_max_position_embeddings": 8}


@pytest.mark.parametrize("config,match", [
    # a TypeError, or a silent replacement (0 and 0.0 are falsy: `or` took the next value)
    ({"rope_parameters": {"rope_type": "default", "rope_theta": [1]}},
     r"rope_theta must be a finite number > 0, got \[1\]"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 0}},
     "rope_theta must be a finite number > 0, got 0"),
    ({"rope_theta": 500000.0, "rope_parameters": {"rope_type": "default", "rope_theta": 0}},
     "rope_theta must be a finite number > 0, got 0"),
    ({"rope_theta": "abc"}, "rope_theta must be a finite number > 0, got 'abc'"),
    ({"rope_parameters": [{"rope_type": "default"}]}, "rope_parameters must be null or a dict"),
    ({"rope_scaling": "linear"}, "rope_scaling must be null or a dict"),
    ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.0}},
     "partial_rotary_factor=0.0 is not supported"),
    ({"partial_rotary_factor": True}, "partial_rotary_factor=True is not supported"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 0}},
     "original_max_position_embeddings must be a positive integer, got 0"),
])
def test_rope_fields_of_the_wrong_kind_are_named_not_replaced(config, match):
    from tinygpt.hf_rope import hf_rope

    with pytest.raises(ValueError, match=match):
        hf_rope({"max_position_embeddings": 64, **config})


def test_an_absent_rope_theta_is_the_familys_default():
    from tinygpt.hf_rope import hf_rope

    assert hf_rope({"max_position_embeddings": 64})[0] == 10000.0
    assert hf_rope({"model_type": "mixtral", "max_position_embeddings": 64})[0] == 1e6
    assert hf_rope({"model_type": "mixtral", "max_position_embeddings": 64,
                    "rope_theta": 5.0})[0] == 5.0



@pytest.mark.parametrize("family", ["llama", "mistral", "qwen3_moe", "mixtral", "deepseek_v3"])
def test_an_absent_max_position_embeddings_is_the_familys_default(family):
    """config.json without the field was refused as "must be a positive integer, got None",
    while transformers builds the model with its config class's default (Llama's 2048,
    Mistral's 131072); an explicit null is still refused, naming what it got."""
    transformers = pytest.importorskip("transformers")
    from tinygpt.hf_rope import hf_rope

    theirs = transformers.CONFIG_MAPPING[family]().max_position_embeddings
    assert hf_rope({"model_type": family})[2] == theirs
    dynamic = {"rope_type": "dynamic", "factor": 2.0}
    assert hf_rope({"model_type": family, "rope_parameters": dynamic})[2] == 2 * theirs
    with pytest.raises(ValueError, match="max_position_embeddings must be a positive integer, "
                                         "got None"):
        hf_rope({"model_type": family, "max_position_embeddings": None})

def test_gguf_writes_and_reads_plain_rope_only(tmp_path):
    """tinygpt.gguf refuses a file with llama.rope.scaling.type or rope_freqs.weight (day 15's
    loader; unchanged), and the benchmark's write_gguf refuses a scaled model instead of
    writing it as plain RoPE."""
    pytest.importorskip("gguf")
    from tinygpt.bench.llamacpp import write_gguf

    cfg = ModelConfig(vocab_size=32, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=48,
                      max_seq_len=64, tie_embeddings=True,
                      rope_scaling={"rope_type": "linear", "factor": 2.0})
    with pytest.raises(ValueError, match="write_gguf writes plain RoPE.*'linear'"):
        write_gguf(TinyGPT(cfg), tmp_path / "m.gguf", "F32")
    assert not (tmp_path / "m.gguf").exists()


def sharpen(model: torch.nn.Module, seed: int, std: float) -> torch.nn.Module:
    """Redraw `model`'s weights (ours or transformers'): matrices std wide, norm weights
    1 +- std. With the default 0.02 attention is nearly uniform and greedy tokens do not
    depend on the positions' angles, so plain RoPE would pick the same ones as a scaling."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_((1 if p.ndim == 1 else 0) + std * torch.randn(p.shape, generator=gen))
    return model


def plain_twin(model: TinyGPT) -> TinyGPT:
    """`model`'s weights with plain RoPE tables (no rope_scaling)."""
    plain = TinyGPT(dataclasses.replace(model.cfg, rope_scaling=()), seed=None).eval()
    plain.load_state_dict(model.state_dict())            # the tables are not in it
    return plain


def test_the_fast_paths_read_the_scaled_tables():
    """Static scalings only change rope_cos / rope_sin: the decode step (tiled or plain) and the
    engine's batched runner read them, and give the uncached model's greedy tokens. The weights
    are sharp enough (0.3 wide) that the same model with plain tables picks other tokens and
    lands far from the decode step's logits, so a path that ignored the scaling would fail."""
    from tinygpt.engine import Engine
    from tinygpt.kv_cache import DecodeStep, KVCache

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    model = TinyGPT(ModelConfig(vocab_size=40, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                d_ff=48, max_seq_len=64, rope_scaling=yarn), seed=1).eval()
    sharpen(model, 1, 0.3)
    plain = plain_twin(model)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 40, (n,), generator=g).tolist() for n in (5, 17, 30)]
    params = SamplingParams(temperature=0, max_new_tokens=20)
    want = [generate(model, p, params, use_cache=False).token_ids for p in prompts]
    assert [generate(plain, p, params, use_cache=False).token_ids for p in prompts] != want
    assert [generate(model, p, params).token_ids for p in prompts] == want
    engine = Engine(model, None, max_running=2, token_budget=16, block_size=4)
    assert [r.token_ids for r in engine.generate(prompts, params)] == want
    for tiled in (True, False):
        cache = KVCache.for_model(model)
        step = DecodeStep(model, cache, tiled=tiled)
        assert step._weights is not None                 # the fused step, not the modules
        with torch.no_grad():
            model(torch.tensor([prompts[1]]), kv_cache=cache)
            got = step(torch.tensor([[3]]))
            ids = torch.tensor([prompts[1] + [3]])
            truth = copy.deepcopy(model).double()(ids)[:, -1]
            err, _ = check_float32_error(f"the decode step (tiled={tiled}) of a YaRN model",
                                         got, model(ids)[:, -1], truth, factor=FACTOR,
                                         floor=FLOOR)
            assert (plain(ids)[:, -1] - truth).abs().max() > 100 * (err + FLOOR)
