"""`make bench-llamacpp`: llama.cpp beside tinygpt on the same weights, batch-1 greedy decode.

An optional extra, not part of `make test`: it needs llama-cpp-python (`pip install
llama-cpp-python==0.3.36`, which compiles llama.cpp: about 25 minutes on the 2-core AVX-512
EPYC, 2026-11-25) and the gguf package. The model has SmolLM2-135M's shape with seeded random
weights (speed does not depend on what the weights say); each format is written as a GGUF
file with the gguf package and decoded by both engines in turn, round after round:

    F32    llama.cpp's F32 file        vs  tinygpt's float32 generate()        target >= 0.8x
    F16    llama.cpp's F16 file        vs  tinygpt in bfloat16 (information)
    Q8_0   llama.cpp's Q8_0 file       vs  tinygpt's Q8_0 tiles (q8_0_model)   target >= 0.8x
    Q4_1   llama.cpp's Q4_1 file       vs  tinygpt's Q4_1 tiles of the SAME blocks (read back
                                           from the file with q4_1_from_gguf)  target >= 0.7x

    engine llama.cpp F32 serving 16 greedy requests of 128 tokens with every sequence in each
           llama_decode (llama_batched)  vs  tinygpt's Engine serving the same   target >= 1.0x
    long   F32 as above after a 1,920-token prompt: each step's attention reads about 2,000
           cached keys and values per layer (a long chat)                        target >= 1.0x
    engine-long-N  the engine row with N requests of about 1,000-token prompts and 64 new
           tokens each (4 and 16): most of the work is prefill, and most steps feed one
           prompt's chunk beside the other sequences' decodes                   target >= 1.0x

The file stores every linear weight in the format (the tied embedding too) and the norms in
float32. Query and key rows are reordered the way llama.cpp's converter does for Llama models,
so both engines compute the same function; the F32 row checks it (greedy tokens compared).
Each format row (F32, F16, Q8_0, Q4_1) also prints teacher-forced agreement: our decode path
reads llama.cpp's greedy tokens and picks the same next token at that many positions (target for
Q4_1: >= 97%); the long row prints the greedy tokens that agree, the engine rows the requests.
A row's ratio is the median of the rounds' own ratios; the tokens/s printed beside it are each
engine's median over the rounds, so the ratio need not equal their quotient.

The command line checks every argument (check_args) before it looks for llama-cpp-python: a bad
one is a single `error: ...` line naming the option and its allowed values (exit 2).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import logging
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from tinygpt import cpu_kernels
from tinygpt.bench.harness import random_prompt
from tinygpt.bench.models import smollm2_config
from tinygpt.generate import CachedLogits, stream
from tinygpt.model import TinyGPT
from tinygpt.roofline import measure_copy_bandwidth
from tinygpt.sampling import SamplingParams

FORMATS = ("F32", "F16", "Q8_0", "Q4_1")      # the GGUF formats main measures, in its order
TARGETS = {"F32": 0.8, "Q8_0": 0.8, "Q4_1": 0.7}
AGREEMENT_TARGETS = {"Q4_1": 0.97}      # teacher-forced, with llama.cpp on the same blocks
ENGINE_TARGET = 1.0        # the Engine's tokens/s over llama.cpp F32 with every sequence batched
LONG_TARGET = 1.0          # generate() over llama.cpp F32 after a long prompt
PROMPT_LEN = 8
LONG_PROMPT_TOKENS = 64    # new tokens per request of the engine-long rows


def unavailable() -> str | None:
    """None when llama-cpp-python and gguf can run here, else why not. llama_cpp is first
    imported in a child process (once per process: _probe): a build for another CPU (a wheel
    compiled with -march=native elsewhere) dies on an illegal instruction as its CPU backend
    loads, which would take this process with it."""
    for name in ("gguf", "llama_cpp"):
        try:
            found = importlib.util.find_spec(name) is not None
        except ValueError:              # None in sys.modules: an import made to fail
            found = False
        if not found:
            return f"{name} is not installed"
    return _probe()


@functools.cache
def _probe() -> str | None:
    probe = subprocess.run([sys.executable, "-c", "import llama_cpp; "
                            "llama_cpp.llama_backend_init(); llama_cpp.llama_print_system_info()"],
                           capture_output=True, timeout=300, check=False)
    if probe.returncode < 0:
        name = signal.Signals(-probe.returncode).name
        return (f"importing llama_cpp died with {name}"
                + (" (built for another CPU: pip install llama-cpp-python==0.3.36 compiles it "
                   "for this one)" if name == "SIGILL" else ""))
    if probe.returncode:
        return f"importing llama_cpp failed: {probe.stderr.decode(errors='replace')[-300:]}"
    return None


def _llama_rows(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """HF / tinygpt rotate-half query or key rows -> llama.cpp's pairwise order."""
    n, k = weight.shape
    return weight.reshape(n_heads, 2, n // n_heads // 2, k).swapaxes(1, 2).reshape(n, k)


def write_gguf(model: TinyGPT, path: Path, fmt: str) -> None:
    """Write `model` (float32, tied embeddings) as a llama-architecture GGUF file whose linear
    weights are in `fmt` ("F32", "F16", "Q8_0" or "Q4_1"), with a placeholder vocabulary.
    A mixture-of-experts or q/k-norm model is refused (ValueError): the file is a dense Llama's."""
    cfg = model.cfg
    if cfg.fast_path_refusal() is not None:
        raise ValueError(f"write_gguf writes a dense llama-architecture file; "
                         f"{cfg.fast_path_refusal()}")
    if cfg.rope_scaling:                  # day 21; tinygpt.gguf refuses scaled files too
        raise ValueError(f"write_gguf writes plain RoPE; the model has rope_scaling "
                         f"{dict(cfg.rope_scaling)!r}")
    import gguf
    import numpy as np

    kind = getattr(gguf.GGMLQuantizationType, fmt)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(cfg.n_layers)
    writer.add_context_length(cfg.max_seq_len)
    writer.add_embedding_length(cfg.d_model)
    writer.add_feed_forward_length(cfg.d_ff)
    writer.add_head_count(cfg.n_heads)
    writer.add_head_count_kv(cfg.n_kv_heads)
    if cfg.n_heads * cfg.head_dim != cfg.d_model:      # llama.cpp's default: embedding / heads
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_base)
    writer.add_layer_norm_rms_eps(cfg.norm_eps)
    writer.add_file_type(kind)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    tokens += [f"t{i}" for i in range(cfg.vocab_size - len(tokens))]
    types = [2, 3, 3] + [6] * 256 + [1] * (cfg.vocab_size - 259)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * cfg.vocab_size)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)

    def linear(name: str, weight: torch.Tensor) -> None:
        w = weight.detach().float().numpy()
        if fmt == "F32":
            writer.add_tensor(name, w)
        elif fmt == "F16":
            writer.add_tensor(name, w.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(w, kind), raw_dtype=kind)

    def norm(name: str, weight: torch.Tensor) -> None:
        writer.add_tensor(name, weight.detach().float().numpy())

    linear("token_embd.weight", model.tok_embeddings.weight)
    for i, block in enumerate(model.layers):
        a, f = block.attention, block.feed_forward
        norm(f"blk.{i}.attn_norm.weight", block.attention_norm.weight)
        linear(f"blk.{i}.attn_q.weight", _llama_rows(a.wq.weight, cfg.n_heads))
        linear(f"blk.{i}.attn_k.weight", _llama_rows(a.wk.weight, cfg.n_kv_heads))
        linear(f"blk.{i}.attn_v.weight", a.wv.weight)
        linear(f"blk.{i}.attn_output.weight", a.wo.weight)
        norm(f"blk.{i}.ffn_norm.weight", block.ffn_norm.weight)
        linear(f"blk.{i}.ffn_gate.weight", f.w1.weight)
        linear(f"blk.{i}.ffn_up.weight", f.w3.weight)
        linear(f"blk.{i}.ffn_down.weight", f.w2.weight)
    norm("output_norm.weight", model.norm.weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def q4_1_blocks(path: Path, model: TinyGPT) -> dict[str, tuple]:
    """The Q4_1 blocks of a file written by write_gguf, as q4_1_model's `blocks` (query and
    key rows put back in tinygpt's order)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    cfg = model.cfg
    names = {"attn_q": "attention.wq", "attn_k": "attention.wk", "attn_v": "attention.wv",
             "attn_output": "attention.wo", "ffn_gate": "feed_forward.w1",
             "ffn_up": "feed_forward.w3", "ffn_down": "feed_forward.w2"}
    out = {}
    for tensor in reader.tensors:
        parts = tensor.name.split(".")
        if tensor.name == "token_embd.weight":
            ours = "output.weight"
        elif parts[0] == "blk" and parts[2] in names:
            ours = f"layers.{parts[1]}.{names[parts[2]]}.weight"
        else:
            continue
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        q, d, m = cpu_kernels.q4_1_from_gguf(torch.from_numpy(tensor.data.copy()).reshape(-1),
                                             shape)
        if parts[-2] in ("attn_q", "attn_k"):             # undo _llama_rows
            heads = cfg.n_heads if parts[-2] == "attn_q" else cfg.n_kv_heads

            def back(x: torch.Tensor, heads: int = heads) -> torch.Tensor:
                n, k = x.shape
                return x.reshape(heads, n // heads // 2, 2, k).swapaxes(1, 2).reshape(n, k)

            q, d, m = back(q), back(d), back(m)
        out[ours] = (q, d, m)
    return out


def llama_seconds_per_token(llm, prompt: list[int], new_tokens: int) -> tuple[float, list[int]]:
    """Median seconds per greedy token of llama.cpp (prefill excluded) and the tokens."""
    import numpy as np

    llm.reset()
    llm.eval(prompt)
    tokens, stamps = [], [time.perf_counter()]
    for _ in range(new_tokens):
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        tokens.append(token)
        llm.eval([token])
        stamps.append(time.perf_counter())
    return statistics.median(b - a for a, b in zip(stamps, stamps[1:], strict=False)), tokens


def llama_batched(path: Path, prompts: list[list[int]], new_tokens: int, threads: int
                  ) -> tuple[float, list[list[int]]]:
    """llama.cpp serving len(prompts) greedy requests at once, as its own server does: one
    llama_decode per step with every prompt (then one new token of every sequence) in the
    batch, each sequence with its own id in the KV cache. Returns (seconds from the first
    prefill to the last token, each sequence's `new_tokens` tokens)."""
    import llama_cpp as L
    import numpy as np

    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)    # its loading chatter
    n_seq, longest = len(prompts), max(len(p) for p in prompts)
    capacity = max(sum(len(p) for p in prompts), n_seq)
    model = L.llama_model_load_from_file(str(path).encode(), L.llama_model_default_params())
    if not model:
        raise RuntimeError(f"llama.cpp could not load {path}")
    params = L.llama_context_default_params()
    params.n_ctx = n_seq * -(-(longest + new_tokens) // 256) * 256    # a whole cache each
    params.n_batch = params.n_ubatch = capacity
    params.n_seq_max = n_seq
    params.n_threads = params.n_threads_batch = threads
    ctx = L.llama_init_from_model(model, params)
    batch = L.llama_batch_init(capacity, 0, 1)
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    try:
        def decode(entries: list[tuple[int, int, int, bool]]) -> None:
            for i, (token, pos, seq, logits) in enumerate(entries):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
                batch.seq_id[i][0], batch.logits[i] = seq, logits
            batch.n_tokens = len(entries)
            if L.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")

        def greedy(index: int) -> int:
            row = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, index), shape=(n_vocab,))
            return int(np.argmax(row))

        start = time.perf_counter()
        entries = [(t, pos, s, pos == len(p) - 1) for s, p in enumerate(prompts)
                   for pos, t in enumerate(p)]
        decode(entries)
        last = [i for i, entry in enumerate(entries) if entry[3]]
        outputs = [[greedy(i)] for i in last]
        for step in range(1, new_tokens):
            decode([(out[-1], len(p) + step - 1, s, True)
                    for s, (p, out) in enumerate(zip(prompts, outputs, strict=True))])
            for s, out in enumerate(outputs):
                out.append(greedy(s))
        return time.perf_counter() - start, outputs
    finally:
        L.llama_batch_free(batch)
        L.llama_free(ctx)
        L.llama_model_free(model)


POOL_BLOCK = 16           # positions per KV block of the engine rows' pools (the default)


def whole_pool(prompts: list[list[int]], new_tokens: int) -> int:
    """Blocks of POOL_BLOCK positions a paged pool needs to hold every prompt and its
    new_tokens whole at once, as llama_batched's context holds them."""
    return sum(-(-(len(p) + new_tokens) // POOL_BLOCK) for p in prompts)


def engine_vs_llama(model: TinyGPT, path: Path, prompts: list[list[int]], new_tokens: int,
                    threads: int, rounds: int) -> dict:
    """tinygpt's Engine and llama.cpp with every prompt in one batch (llama_batched), each
    serving all `prompts` greedily for `new_tokens` tokens, in turn, `rounds` times; the
    clock runs from the first prefill to the last token for both. Returns tokens/s per round
    for each, the median ratio of the rounds (engine over llama.cpp) and the last round's
    outputs of both. The engine's pool holds every sequence whole, as llama.cpp's context
    does (llama_batched)."""
    from tinygpt.engine import Engine

    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens)
    engine = Engine(model, max_running=len(prompts), block_size=POOL_BLOCK,
                    num_blocks=max(whole_pool(prompts, new_tokens), len(prompts) * 32))
    engine.generate(prompts[:2], SamplingParams(temperature=0.0, max_new_tokens=2))  # warm-up
    llama_batched(path, prompts[:2], 2, threads)
    tokens = len(prompts) * new_tokens
    ours, theirs = [], []
    for _ in range(rounds):
        seconds, llama_out = llama_batched(path, prompts, new_tokens, threads)
        theirs.append(tokens / seconds)
        start = time.perf_counter()
        results = engine.generate(prompts, params)
        ours.append(sum(len(r.token_ids) for r in results) / (time.perf_counter() - start))
    return {"engine_tokens_per_s": ours, "llama_tokens_per_s": theirs,
            "ratio": statistics.median(a / b for a, b in zip(ours, theirs, strict=True)),
            "outputs": [r.token_ids for r in results], "llama_outputs": llama_out,
            "batched_products": engine.runner.batched}


def ours_seconds_per_token(model: TinyGPT, prompt: list[int], new_tokens: int
                           ) -> tuple[float, list[int]]:
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens + 1)
    stamps, tokens = [], []
    for event in stream(model, prompt, params):
        stamps.append(time.perf_counter())
        tokens.append(event.token_id)
    return statistics.median(b - a for a, b in zip(stamps, stamps[1:], strict=False)), \
        tokens[:new_tokens]


def long_context_vs_llama(model: TinyGPT, path: Path, context: int, new_tokens: int,
                          threads: int, rounds: int) -> dict:
    """Both engines' median seconds per greedy token after a `context`-token prompt (prefill
    excluded), in turn, round after round, and how many of the greedy tokens agree."""
    from llama_cpp import Llama

    prompt = random_prompt(context, model.cfg.vocab_size, 1)
    llm = Llama(model_path=str(path), n_ctx=context + new_tokens + 8, n_threads=threads,
                n_batch=512, verbose=False, logits_all=True)
    llama_s, ours_s = [], []
    for _ in range(rounds):
        s_llama, t_llama = llama_seconds_per_token(llm, prompt, new_tokens)
        s_ours, t_ours = ours_seconds_per_token(model, prompt, new_tokens)
        llama_s.append(s_llama)
        ours_s.append(s_ours)
    return {"llama": llama_s, "ours": ours_s,
            "ratio": statistics.median(a / b for a, b in zip(llama_s, ours_s, strict=True)),
            "same": sum(a == b for a, b in zip(t_llama, t_ours, strict=True))}


def teacher_forced(model: TinyGPT, prompt: list[int], tokens: list[int]) -> int:
    """How many of llama.cpp's greedy `tokens` after `prompt` our decode path (generate()'s:
    prefill, then one decode step per token) also picks when it reads llama.cpp's tokens so
    far (teacher forcing: one early difference does not count again at every later token)."""
    logits = CachedLogits(model, len(prompt), len(tokens))
    ids, same = list(prompt), 0
    with torch.inference_mode():
        for token in tokens:
            same += int(logits(torch.tensor([ids])).argmax(-1)) == token
            ids.append(token)
    return same


def parse_formats(text: str) -> list[str]:
    """--formats "F32,Q8_0" -> ["F32", "Q8_0"]: distinct names from FORMATS, else a ValueError
    naming the option and the allowed values."""
    formats = text.split(",")
    if any(f not in FORMATS for f in formats) or len(set(formats)) < len(formats):
        raise ValueError(f"--formats must be distinct names from {','.join(FORMATS)}, "
                         f"comma-separated; got {text!r}")
    return formats


def parse_long_requests(text: str) -> list[int]:
    """--long-requests "4,16" -> [4, 16]: each an int >= 1, else a ValueError naming it."""
    try:
        counts = [int(n) for n in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise ValueError(f"--long-requests must be comma-separated ints >= 1, as 4,16; "
                         f"got {text!r}")
    return counts


def check_args(args: argparse.Namespace, max_seq_len: int) -> tuple[list[str], list[int]]:
    """Every argument, before the install check and any work: counts >= 1 (>= 0 where the
    help says 0 turns a row off), known formats, and each row's longest prompt + new tokens
    + 1 within the model's `max_seq_len` positions. Returns (the formats, the engine-long
    request counts); a ValueError naming the option and its allowed values otherwise."""
    import tinygpt

    for name, value, least in (("--tokens", args.tokens, 1), ("--rounds", args.rounds, 1),
                               ("--engine-requests", args.engine_requests, 0),
                               ("--engine-tokens", args.engine_tokens, 1),
                               ("--long-prompts", args.long_prompts, 0),
                               ("--long-context", args.long_context, 0)):
        if value < least:
            off = " (0: no such rows)" if least == 0 else ""
            raise ValueError(f"{name} must be an int >= {least}{off}, got {value}")
    tinygpt.thread_count(args.threads, "--threads")
    formats, long_requests = parse_formats(args.formats), parse_long_requests(args.long_requests)
    longest = [(f"--tokens {args.tokens}", PROMPT_LEN, args.tokens)]   # (options, prompt, new)
    if args.long_context:
        longest.append((f"--long-context {args.long_context} + --tokens {args.tokens}",
                        args.long_context, args.tokens))
    if args.engine_requests:
        longest.append((f"--engine-requests {args.engine_requests} + --engine-tokens "
                        f"{args.engine_tokens}", PROMPT_LEN + args.engine_requests - 1,
                        args.engine_tokens))
    if args.long_prompts:
        longest.append((f"--long-prompts {args.long_prompts} + --long-requests "
                        f"{args.long_requests}", args.long_prompts + max(long_requests) - 1,
                        LONG_PROMPT_TOKENS))
    for options, prompt, new in longest:
        if prompt + new + 1 > max_seq_len:
            raise ValueError(f"{options}: the longest request's {prompt}-token prompt + {new} "
                             f"new tokens + 1 exceeds the model's {max_seq_len} positions")
    return formats, long_requests


def main(argv: list[str] | None = None) -> int:
    """`python -m tinygpt.bench.llamacpp [--formats F32,Q8_0] [--tokens N] ...`: the table of
    the module docstring. A bad argument is one `error: ...` line (exit 2), checked before
    llama-cpp-python's install check (check_args)."""
    parser = argparse.ArgumentParser(prog="python -m tinygpt.bench.llamacpp",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per run (64)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (3)")
    parser.add_argument("--threads", type=int, default=2, help="threads for both (2)")
    parser.add_argument("--formats", default=",".join(FORMATS),
                        help=f"comma-separated, from {','.join(FORMATS)} (all; the engine and "
                             f"long rows need F32)")
    parser.add_argument("--engine-requests", type=int, default=16,
                        help="concurrent requests of the engine row (16; 0: no engine row)")
    parser.add_argument("--engine-tokens", type=int, default=128,
                        help="new tokens per engine request (128)")
    parser.add_argument("--long-prompts", type=int, default=1000,
                        help="prompt tokens of the engine-long rows (1000; 0: no such rows)")
    parser.add_argument("--long-requests", default="4,16",
                        help="concurrent requests of the engine-long rows (4,16)")
    parser.add_argument("--long-context", type=int, default=1920,
                        help="prompt tokens of the long-context F32 row (1920; 0: no such row; "
                             "with --tokens at most the model's 2048 positions)")
    cfg = smollm2_config()
    try:
        args = parser.parse_args(argv)
        formats, long_requests = check_args(args, cfg.max_seq_len)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if "F32" not in formats and (args.engine_requests or args.long_prompts
                                 or args.long_context):
        print("note: the engine, engine-long and long-context rows run on the F32 file; "
              "without F32 in --formats none of them runs", file=sys.stderr)
    if (why := unavailable()) is not None:
        print(f"error: {why}; pip install llama-cpp-python==0.3.36 gguf (compiles llama.cpp, "
              f"about 25 minutes)", file=sys.stderr)
        return 2
    from llama_cpp import Llama
    torch.set_num_threads(args.threads)
    model = TinyGPT(cfg, seed=0).eval()
    prompt = random_prompt(PROMPT_LEN, cfg.vocab_size, 0)
    rows: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        engines = {}
        for fmt in formats:
            path = Path(tmp) / f"smollm2-shape-{fmt}.gguf"
            print(f"writing {path.name} ...", file=sys.stderr, flush=True)
            write_gguf(model, path, fmt)
            if fmt == "F32":
                mine = model
            elif fmt == "F16":
                mine = TinyGPT(cfg, seed=0).to(torch.bfloat16).eval()
            elif fmt == "Q8_0":
                mine = cpu_kernels.q8_0_model(model)
            else:                                   # Q4_1, the last of FORMATS
                mine = cpu_kernels.q4_1_model(model, q4_1_blocks(path, model))
            # logits_all: llama-cpp-python 0.3.36 leaves `scores` at zero without it (every
            # greedy token read back was token 0); decode evaluates one token either way
            llm = Llama(model_path=str(path), n_ctx=PROMPT_LEN + args.tokens + 8,
                        n_threads=args.threads, n_batch=64, verbose=False, logits_all=True)
            engines[fmt] = (llm, mine)
            rows[fmt] = {"llama": [], "ours": []}
        copies, agree, forced = [], {}, {}
        for _ in range(args.rounds):
            for fmt, (llm, mine) in engines.items():
                s_llama, t_llama = llama_seconds_per_token(llm, prompt, args.tokens)
                s_ours, t_ours = ours_seconds_per_token(mine, prompt, args.tokens)
                rows[fmt]["llama"].append(s_llama)
                rows[fmt]["ours"].append(s_ours)
                agree[fmt] = sum(a == b for a, b in zip(t_llama, t_ours, strict=True))
                forced[fmt] = t_llama
            copies.append(measure_copy_bandwidth(repeats=3))
        forced = {fmt: teacher_forced(engines[fmt][1], prompt, tokens)
                  for fmt, tokens in forced.items()}
        long_row = None
        if "F32" in formats and args.long_context > 0:
            print(f"F32 after a {args.long_context}-token prompt ...", file=sys.stderr,
                  flush=True)
            long_row = long_context_vs_llama(model, Path(tmp) / "smollm2-shape-F32.gguf",
                                             args.long_context, args.tokens, args.threads,
                                             args.rounds)
        engine = None
        if "F32" in formats and args.engine_requests > 0:
            print(f"the engine and llama.cpp, {args.engine_requests} requests at once ...",
                  file=sys.stderr, flush=True)
            prompts = [random_prompt(PROMPT_LEN + i, cfg.vocab_size, 10 + i)
                       for i in range(args.engine_requests)]
            engine = engine_vs_llama(model, Path(tmp) / "smollm2-shape-F32.gguf", prompts,
                                     args.engine_tokens, args.threads, args.rounds)
        long_engine = {}
        if "F32" in formats and args.long_prompts > 0:
            for n in long_requests:
                print(f"the engine and llama.cpp, {n} requests of {args.long_prompts}-token "
                      f"prompts ...", file=sys.stderr, flush=True)
                prompts = [random_prompt(args.long_prompts + i, cfg.vocab_size, 10 + i)
                           for i in range(n)]
                long_engine[n] = engine_vs_llama(model, Path(tmp) / "smollm2-shape-F32.gguf",
                                                 prompts, LONG_PROMPT_TOKENS, args.threads,
                                                 args.rounds)
    print(f"\nllama.cpp vs tinygpt, SmolLM2-135M shape, batch-1 greedy, {args.tokens} tokens, "
          f"{args.threads} threads, {args.rounds} rounds; copy bandwidth "
          f"{statistics.median(copies) / 1e9:.1f} GB/s")
    print(f"{'format':8} {'llama.cpp tok/s':>16} {'tinygpt tok/s':>14} {'ratio':>7} "
          f"{'target':>7}  same greedy tokens, teacher-forced")
    for fmt in formats:
        ratio = statistics.median(a / b for a, b in zip(rows[fmt]["llama"], rows[fmt]["ours"],
                                                         strict=True))
        target = TARGETS.get(fmt)
        verdict = "information" if target is None else \
            "met" if ratio >= target else f"NOT MET ({ratio:.2f}x < {target}x)"
        agreement, wanted = forced[fmt] / args.tokens, AGREEMENT_TARGETS.get(fmt)
        if wanted is not None and agreement < wanted:
            verdict += f"; NOT MET (teacher-forced agreement {agreement:.1%} < {wanted:.0%})"
        print(f"{fmt:8} {1 / statistics.median(rows[fmt]['llama']):16.1f} "
              f"{1 / statistics.median(rows[fmt]['ours']):14.1f} {ratio:6.2f}x "
              f"{'' if target is None else f'>={target}x':>7}  {agree[fmt]}/{args.tokens}, "
              f"{forced[fmt]}/{args.tokens}  {verdict}")
    if long_row is not None:
        ratio = long_row["ratio"]
        verdict = "met" if ratio >= LONG_TARGET else f"NOT MET ({ratio:.2f}x < {LONG_TARGET}x)"
        name = f"F32@{args.long_context}"
        print(f"{name:8} {1 / statistics.median(long_row['llama']):16.1f} "
              f"{1 / statistics.median(long_row['ours']):14.1f} {ratio:6.2f}x "
              f"{f'>={LONG_TARGET}x':>7}  {long_row['same']}/{args.tokens}  {verdict}  (after a "
              f"{args.long_context}-token prompt)")
    print(f"tok/s: 1 / the median over {args.rounds} rounds of each round's median seconds per "
          f"token; ratio: the median of the {args.rounds} rounds' own ratios (tinygpt over "
          f"llama.cpp), not the quotient of the tok/s columns")
    if engine is not None or long_engine:
        print(f"\nthe engine, concurrent greedy requests (llama.cpp: every sequence in each "
              f"llama_decode; tokens/s from the first prefill to the last token); load "
              f"average {os.getloadavg()[0]:.2f}")
        print(f"tokens/s: the median of {args.rounds} rounds' tokens/s for each; ratio: the "
              f"median of the rounds' own ratios (engine over llama.cpp)")
    if engine is not None:
        print_engine_row("engine", engine, f"{args.engine_requests} requests of "
                         f"{PROMPT_LEN}-{PROMPT_LEN + args.engine_requests - 1}-token prompts, "
                         f"{args.engine_tokens} new tokens each")
    for n, row in long_engine.items():
        print_engine_row(f"engine-long-{n}", row, f"{n} requests of {args.long_prompts}-"
                         f"{args.long_prompts + n - 1}-token prompts, {LONG_PROMPT_TOKENS} new "
                         f"tokens each")
    return 0


def print_engine_row(name: str, row: dict, what: str) -> None:
    ratio = row["ratio"]
    same = sum(a == b for a, b in zip(row["outputs"], row["llama_outputs"], strict=True))
    verdict = "met" if ratio >= ENGINE_TARGET else f"NOT MET ({ratio:.2f}x < {ENGINE_TARGET}x)"
    print(f"{name:15} {statistics.median(row['llama_tokens_per_s']):9.1f} "
          f"{statistics.median(row['engine_tokens_per_s']):14.1f} {ratio:6.2f}x "
          f"{f'>={ENGINE_TARGET}x':>7}  {same}/{len(row['outputs'])} requests the same  "
          f"{verdict}  ({what})")


if __name__ == "__main__":
    sys.exit(main())
