"""The server on the real model against generate() and llama.cpp: what a user of it gets.

`python -m tinygpt bench --only serve_speed` (full plan, CPU; `make bench-llamacpp` runs it
after its own table). SmolLM2-135M-Instruct in float32 is served by `python -m tinygpt serve
--model smollm2` (a subprocess: one server process, real HTTP, streamed `/v1/completions`,
greedy, ignore_eos, no prefix cache: llama.cpp's side has none); llama.cpp (llama-cpp-python,
when installed) decodes the same weights written as an F32 GGUF file; `generate()` runs in
this process. Every row's ratio is the median of its rounds' own ratios, the contenders
taking turns within a round (_one_stream says why), the rates printed beside it medians.

    serve_stream_1             one stream: its decode rate over generate()'s     >= 0.95x
    serve_stream_1_llamacpp    the same over llama.cpp F32's                      >= 1.0x
    serve_streams_4 / _16      4 / 16 concurrent streams: tokens/s over llama.cpp
                               with as many sequences in each decode              >= 1.0x
    serve_streams_long_4 / _16 the same with prompts of about 1,000 tokens and 64 new
                               tokens each: mostly prefill, chunks beside decodes  >= 1.0x
    chat_stream_1              `python -m tinygpt chat --stats`' decode rate over
                               generate()'s (information: chat runs generate())

Two statistics, each named in its row: a DECODE RATE is (tokens - 1) / (seconds from the
first token to the last), the prompt excluded (one stream; llama.cpp's timed the same way
around its llama_eval calls); THROUGHPUT is all tokens over the seconds from the first request
to the last token, prefill included (several streams; llama.cpp's llama_batched times the same
span). The served texts are also compared with batch-1 generate()'s: greedy decoding promises
the same tokens, and a row with a difference is NOT MET. The server's KV pool is sized for
every sequence of the largest row whole (--kv-blocks), as llama.cpp's context is; its default
pool (256 MiB, 5,824 of SmolLM2's positions) would hold five of the long rows' sixteen.
"""

from __future__ import annotations

import http.client
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

from tinygpt.bench.harness import Comparison
from tinygpt.bench.registry import BenchContext, register
from tinygpt.generate import generate, stream
from tinygpt.sampling import SamplingParams

STREAM_TARGET = 0.95       # one served stream over generate()
LLAMA_TARGET = 1.0         # the server over llama.cpp F32, at every concurrency
STREAMS = (4, 16)
LONG_PROMPT = 1000         # prompt tokens of the serve_streams_long rows (about)
LONG_TOKENS = 64           # new tokens per request in those rows
STREAM_ROUNDS = 9          # rounds of the one-stream rows (about 13 s each with llama.cpp on
                           # the AVX2 EPYC, 2026-11-29)
STREAMS_ROUNDS = 5         # rounds of the several-stream rows (30 s to 2 minutes each with
                           # llama.cpp on the AVX2 EPYC, 2026-11-29)


def decode_rate(stamps: list[float]) -> float:
    """(tokens - 1) / (last - first): tokens per second after the first, one stamp a token."""
    if len(stamps) < 2 or stamps[-1] <= stamps[0]:
        raise ValueError(f"a decode rate needs two or more increasing stamps, got {stamps}")
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def generate_rate(model, prompt: list[int], tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_new_tokens=tokens)
    return decode_rate([time.perf_counter() for _ in stream(model, prompt, params)])


def served_rate(url: str, model_id: str, prompt: list[int], tokens: int) -> tuple[float, str]:
    """One greedy streamed completion: (its decode rate, its text). A chunk is stamped when it
    arrives; the server sends one per token (usage's completion_tokens is checked).

    The client is the standard library's http.client, reading the event stream line by line:
    it shares the two cores with the server's two product threads, and its CPU is taken from
    them. Per 128-token stream on the AVX2 EPYC (2026-11-29, six rounds each, taking turns):
    0.031 s of CPU and 34.0 tokens/s served, against httpx's 0.087 s and 32.9."""
    body = {"model": model_id, "prompt": prompt, "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    stamps, pieces, usage = [], [], None
    where = urlsplit(url)
    connection = http.client.HTTPConnection(where.hostname, where.port, timeout=300)
    try:
        connection.request("POST", "/v1/completions", json.dumps(body),
                           {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read()!r}")
        while line := response.readline():
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]["completion_tokens"]
            if chunk["choices"]:
                stamps.append(time.perf_counter())
                pieces.append(chunk["choices"][0]["text"])
    finally:
        connection.close()
    if usage != tokens or len(stamps) != tokens:
        raise RuntimeError(f"expected {tokens} tokens in as many chunks, got {usage} tokens in "
                           f"{len(stamps)} chunks")
    return decode_rate(stamps), "".join(pieces)


def llama_rate(llm, prompt: list[int], tokens: int) -> tuple[float, list[int]]:
    """llama.cpp's greedy decode: (its decode rate, the tokens). A token's stamp is when its
    logits are ready (after the prompt's eval for the first)."""
    import numpy as np

    llm.reset()
    llm.eval(prompt)
    out, stamps = [], []
    for _ in range(tokens):
        stamps.append(time.perf_counter())
        out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        if len(out) < tokens:
            llm.eval([out[-1]])
    return decode_rate(stamps), out


def chat_rate(name: str, tokens: int, threads: int) -> float:
    """`python -m tinygpt chat --model name --stats` as a user runs it (a process of its own,
    in the user's environment: load.user_environment), one greedy reply: its decode rate as
    the stats line prints it."""
    from tinygpt.bench.load import user_environment

    done = subprocess.run([sys.executable, "-m", "tinygpt", "chat", "--model", name,
                           "--temperature", "0", "--max-tokens", str(tokens), "--threads",
                           str(threads), "--stats"],
                          input="Tell me a long story about a dog and a cat.\n",
                          capture_output=True, text=True, env=user_environment(),
                          timeout=600, check=False)
    found = re.search(r"then (\d+\.\d) tokens/s\)", done.stdout)
    if done.returncode != 0 or found is None:
        raise RuntimeError(f"the chat did not print its stats (exit {done.returncode}): "
                           f"{(done.stdout + done.stderr)[-500:]!r}")
    return float(found.group(1))


@register("serve_speed", day=17)
def serve_speed(ctx: BenchContext) -> list[Comparison]:
    """The server on SmolLM2 against generate() and llama.cpp F32: 1, 4 and 16 streams."""
    from tinygpt.gguf import smollm2_path

    if not ctx.on_cpu:
        return ctx.skip("serve_speed", f"these rows are for the CPU, not {ctx.device}")
    if ctx.quick:
        return ctx.skip("serve_speed", "a server start and llama.cpp: the full plan only")
    try:
        smollm2_path()
    except FileNotFoundError as err:
        return ctx.skip("serve_speed", str(err), targeted=True)
    return serve_speed_rows(ctx, "smollm2", tokens=128, rounds=STREAMS_ROUNDS, streams=STREAMS,
                            long_prompt=LONG_PROMPT, stream_rounds=STREAM_ROUNDS)


def serve_speed_rows(ctx: BenchContext, name: str, *, tokens: int, rounds: int,
                     streams: tuple[int, ...], long_prompt: int = 0,
                     stream_rounds: int | None = None) -> list[Comparison]:
    """The rows for model `name` (load_model's names): `tokens` new tokens per request;
    `rounds` of each several-stream row and `stream_rounds` (default 2 * rounds - 1) of the
    one-stream rows; long_prompt > 0 adds the serve_streams_long rows (prompts of long_prompt
    tokens and a few more, LONG_TOKENS new tokens each)."""
    from tinygpt.bench.engine import serving_requests
    from tinygpt.bench.llamacpp import whole_pool
    from tinygpt.bench.load import running_server
    from tinygpt.loading import load_model

    model, tokenizer, info = load_model(name)
    prompts = serving_requests(tokenizer, max(streams, default=1), ctx.seed)
    params = SamplingParams(temperature=0.0, max_new_tokens=tokens)
    ctx.log(f"serve_speed: {info.model_id}, batch-1 generate() of {len(prompts)} prompts "
            f"(the texts the server must give) ...")
    expected = [generate(model, p, params, tokenizer=tokenizer).text for p in prompts]
    longs, long_expected = [], []
    if long_prompt and streams:
        longs = serving_requests(tokenizer, max(streams), ctx.seed,
                                 (long_prompt, long_prompt + max(streams)))
        ctx.log(f"serve_speed: batch-1 generate() of {len(longs)} prompts of about "
                f"{long_prompt} tokens ...")
        long_params = SamplingParams(temperature=0.0, max_new_tokens=LONG_TOKENS)
        long_expected = [generate(model, p, long_params, tokenizer=tokenizer).text
                         for p in longs]
    # every sequence of the largest row whole in the pool, as llama.cpp's context holds them
    blocks = max(whole_pool(prompts, tokens), whole_pool(longs, LONG_TOKENS))
    with tempfile.TemporaryDirectory() as tmp:
        llama, missing = _llama(model, Path(tmp) / "model-F32.gguf", ctx.threads, tokens)
        if missing:       # a targeted row that cannot run here: recorded, counted as a miss
            ctx.skip("serve_stream_1_llamacpp", f"llama.cpp not measured ({missing}: the "
                     f"optional llama-cpp-python extra, see the README)", targeted=True)
        try:
            with running_server("--model", name, "--threads", str(ctx.threads),
                                "--no-prefix-caching", "--kv-blocks", str(blocks),
                                timeout=300.0) as (url, _):
                served_rate(url, info.model_id, prompts[0], 4)                   # warm-up
                rows = _one_stream(ctx, model, url, info.model_id, prompts[0], expected[0],
                                   tokens, stream_rounds or 2 * rounds - 1, llama)
                for n in streams:
                    rows.append(_streams(ctx, url, info.model_id, prompts[:n], expected[:n],
                                         tokens, rounds, llama))
                for n in streams if longs else ():
                    rows.append(_streams(ctx, url, info.model_id, longs[:n],
                                         long_expected[:n], LONG_TOKENS, rounds, llama,
                                         name=f"serve_streams_long_{n}"))
        finally:
            if llama:
                llama[0].close()
    rows.append(_chat(ctx, name, model, prompts[0], tokens, min(rounds, 3), info.model_id))
    return rows


def _chat(ctx, name, model, prompt, tokens, rounds, model_id) -> Comparison:
    """The chat row: `rounds` rounds in which `tinygpt chat` (a process of its own) and
    generate() in this one take turns going first; the median of the rounds' ratios (the
    machine's speed moves between minutes: a ratio against the one-stream rounds, minutes
    earlier, does not cancel that)."""
    ctx.log(f"serve_speed: `tinygpt chat --stats`, {rounds} round(s) beside generate() ...")
    rates: dict[str, list[float]] = {"chat": [], "generate": []}
    for r in range(rounds):
        for who in ("chat", "generate") if r % 2 == 0 else ("generate", "chat"):
            rates[who].append(chat_rate(name, tokens, ctx.threads) if who == "chat"
                              else generate_rate(model, prompt, tokens))
    ratio = statistics.median([a / b for a, b in zip(rates["chat"], rates["generate"],
                                                     strict=True)])
    chat, gen = (statistics.median(rates[who]) for who in ("chat", "generate"))
    summary = (f"median of {rounds} rounds' ratios; the rates' medians: chat {chat:.1f}, "
               f"generate() {gen:.1f} decode tokens/s")
    met = ratio >= STREAM_TARGET          # printed, never counted (information only)
    return Comparison(
        "chat_stream_1", f"`python -m tinygpt chat --stats`, one greedy reply of up to "
        f"{tokens} tokens: its decode rate over generate()'s ({model_id}; chat runs "
        f"generate(), the reply's own prompt)", ratio, STREAM_TARGET, ">=", "x", met,
        None if met else f"{ratio:.2f}x ({summary})",
        {"summary": summary, "chat_rate": chat, "rounds": rates}, targeted=False)


def _llama(model, path: Path, threads: int, tokens: int):
    """(a llama_cpp.Llama on `model` written as an F32 GGUF at `path`, None) or (None, why)."""
    from tinygpt.bench.llamacpp import unavailable, write_gguf

    if (why := unavailable()) is not None:
        return None, why
    from llama_cpp import Llama

    write_gguf(model, path, "F32")
    llm = Llama(model_path=str(path), n_ctx=256 + tokens, n_threads=threads, n_batch=128,
                verbose=False, logits_all=True)
    return (llm, path), None


def _one_stream(ctx, model, url, model_id, prompt, expected, tokens, rounds, llama
                ) -> list[Comparison]:
    """The one-stream rows. Each round runs generate(), the served stream and llama.cpp once,
    in an order that rotates from round to round (no contender always runs after the same
    one); a row's ratio is the median of its rounds' ratios, each taken within one round: on
    the shared 2-core AVX2 EPYC (2026-11-29) one round's rates move by about 10%, a slow
    stretch moves every contender of that round together, and the ratio of two medians taken
    from different rounds does not cancel it."""
    texts = set()

    def served_once() -> float:
        rate, text = served_rate(url, model_id, prompt, tokens)
        texts.add(text)
        return rate

    runs = {"generate": lambda: generate_rate(model, prompt, tokens), "served": served_once}
    if llama:
        runs["llama"] = lambda: llama_rate(llama[0], prompt, tokens)[0]
    names = list(runs)
    rates: dict[str, list[float]] = {name: [] for name in names}
    ctx.log(f"serve_speed: one stream of {tokens} tokens, {rounds} rounds: generate(), the "
            f"server{', llama.cpp' if llama else ''}, in an order that rotates ...")
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            rates[name].append(runs[name]())
    median = statistics.median
    served = median(rates["served"])
    same = texts == {expected}

    def row(name: str, over: str, label: str, target: float, description: str,
            details: dict) -> Comparison:
        """served over contender `over`: the median of the rounds' own ratios"""
        theirs = median(rates[over])
        ratio = median([a / b for a, b in zip(rates["served"], rates[over], strict=True)])
        what = (f"median of {rounds} rounds' ratios; the rates' medians: served {served:.1f}, "
                f"{label} {theirs:.1f} decode tokens/s")
        reasons = [] if same else ["the served text differs from batch-1 generate()'s"]
        if ratio < target:
            reasons.append(f"{ratio:.2f}x ({what})")
        return Comparison(name, description, ratio, target, ">=", "x", not reasons,
                          "; ".join(reasons) or None, {"summary": what, **details})

    rows = [row("serve_stream_1", "generate", "generate()", STREAM_TARGET,
                f"one streamed greedy completion of {tokens} tokens through the server: its "
                f"decode rate over generate()'s in process ({model_id}, float32)",
                {"served_rate": served, "generate_rate": median(rates["generate"]),
                 "rounds": rates, "identical_text": same})]
    if llama:
        rows.append(row("serve_stream_1_llamacpp", "llama", "llama.cpp", LLAMA_TARGET,
                        f"the same stream's decode rate over llama.cpp F32's on the same "
                        f"weights ({ctx.threads} threads each)",
                        {"llama_rate": median(rates["llama"])}))
    return rows


def _streams(ctx, url, model_id, prompts, expected, tokens, rounds, llama, name=None
             ) -> Comparison:
    from tinygpt.bench.llamacpp import llama_batched
    from tinygpt.bench.load import run_concurrent_streams

    n = len(prompts)
    name = name or f"serve_streams_{n}"
    shortest, longest = min(map(len, prompts)), max(map(len, prompts))
    what = f"{tokens} tokens after prompts of {shortest}-{longest} tokens"
    ctx.log(f"serve_speed: {n} concurrent streams of {what}, {rounds} rounds ...")
    ours, theirs, texts = [], [], []

    def served_once() -> None:
        seconds, got = run_concurrent_streams(url, prompts, tokens, model=model_id)
        ours.append(n * tokens / seconds)
        texts.append(got)

    def llama_once() -> None:
        theirs.append(n * tokens / llama_batched(llama[1], prompts, tokens, ctx.threads)[0])

    turns = [llama_once, served_once] if llama else [served_once]
    for r in range(rounds):                    # who goes first alternates
        for run in turns[r % len(turns):] + turns[:r % len(turns)]:
            run()
    same = all(got == expected for got in texts)
    served = statistics.median(ours)
    reasons = [] if same else ["a served text differs from batch-1 generate()'s"]
    details = {"served_tokens_per_s": served, "rounds_served": ours, "identical_text": same}
    if not llama:
        return Comparison(
            name, f"{n} concurrent streamed greedy completions of {what} through the server: "
            f"throughput, tokens/s (llama.cpp not installed: no ratio)", served, 0.0,
            ">=", "tokens/s", same, "; ".join(reasons) or None,
            {**details, "summary": f"served {served:.1f} tokens/s"}, targeted=False)
    llama_tps = statistics.median(theirs)
    # as the one-stream rows (_one_stream says why): the median of the rounds' own ratios
    ratio = statistics.median([a / b for a, b in zip(ours, theirs, strict=True)])
    stat = (f"median of {rounds} rounds' ratios; the throughputs' medians: served "
            f"{served:.1f}, llama.cpp {llama_tps:.1f} tokens/s")
    if ratio < LLAMA_TARGET:
        reasons.append(f"{ratio:.2f}x ({stat})")
    return Comparison(
        name, f"{n} concurrent streamed greedy completions of {what} through the "
        f"server over llama.cpp F32 with {n} sequences in each decode: throughput (prefill "
        f"included), tokens/s", ratio, LLAMA_TARGET, ">=", "x", not reasons,
        "; ".join(reasons) or None,
        {**details, "llama_tokens_per_s": llama_tps, "rounds_llama": theirs,
         "summary": stat})
