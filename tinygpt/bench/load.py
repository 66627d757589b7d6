"""A load generator for `python -m tinygpt serve`: Poisson arrivals, a mix of request sizes.

    python -m tinygpt bench serve --url http://127.0.0.1:8000 --rates 1,2,4,8 --requests 32

A serving benchmark asks how much traffic a server carries while each request still meets its
service-level objectives. Requests arrive as a Poisson process (independent arrivals at an
average `rate` per second: exponential gaps, the usual model of many independent users), each
with a prompt length and an output length drawn from a mix (short chats and a few long
prompts). Every request streams; the arrival time of each chunk is a token time, so the day-12
metrics apply unchanged: TTFT, ITL, TPOT, end-to-end latency, and goodput, the requests per
second that met both SLOs. Sweeping the rate gives the curve serving papers plot: goodput
follows the offered rate until the server saturates, then falls away from it.

Prompts are token ids below 256 (byte tokens every byte-level BPE vocabulary has) and requests
ask for `ignore_eos`, so each produces exactly its drawn output length.

The command line checks every argument before the first request (the URL's scheme and host,
the rates, the counts and how long their arrivals would take, the SLOs, the output files) and
refuses a bad one with a single `error: ...` line (exit 2); a server it cannot reach is one
`error: cannot reach ...` line (exit 1).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from tinygpt.metrics import RequestTrace, request_metrics

MAX_SEED = 2**32 - 1           # --seed's range, as `python -m tinygpt bench --seed`
MAX_REQUESTS = 100_000         # --requests' bound: each rate plans them all and opens each
MAX_ARRIVALS_S = 24 * 3600     # the longest the arrivals of all the rates may be expected to take

# (prompt tokens, output tokens, weight): mostly short exchanges, some long prompts, a few
# long answers
DEFAULT_MIX = ((16, 32, 5), (64, 64, 3), (256, 32, 1), (32, 192, 1))


@dataclass(frozen=True)
class PlannedRequest:
    at: float            # seconds after the start
    prompt_len: int
    output_len: int
    seed: int


def plan_requests(n: int, rate: float, mix: Sequence[tuple[int, int, int]] = DEFAULT_MIX,
                  seed: int = 0) -> list[PlannedRequest]:
    """n requests with Poisson arrivals at `rate` per second (exponential gaps, seeded) and
    sizes drawn from `mix` ((prompt_len, output_len, weight) triples)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    if not rate > 0:
        raise ValueError(f"rate must be > 0 requests per second, got {rate!r}")
    if not mix or any(p < 1 or o < 1 or w <= 0 for p, o, w in mix):
        raise ValueError(f"mix must be (prompt_len >= 1, output_len >= 1, weight > 0) "
                         f"triples, got {mix!r}")
    rng = random.Random(seed)
    at, out = 0.0, []
    for i in range(n):
        at += rng.expovariate(rate)
        prompt_len, output_len, _ = rng.choices(mix, weights=[w for *_, w in mix])[0]
        out.append(PlannedRequest(at, prompt_len, output_len, seed * 100_003 + i))
    return out


async def _one(client, url: str, start: float, planned: PlannedRequest,
               timeout: float, model: str) -> tuple[RequestTrace | None, str | None]:
    await asyncio.sleep(max(0.0, start + planned.at - time.perf_counter()))
    rng = random.Random(planned.seed)
    body = {"model": model, "prompt": [rng.randrange(256) for _ in range(planned.prompt_len)],
            "max_tokens": planned.output_len, "temperature": 0, "ignore_eos": True,
            "stream": True}
    submitted, times = time.perf_counter(), []
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body,
                                 timeout=timeout) as response:
            if response.status_code != 200:
                return None, f"HTTP {response.status_code}"
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    times.append(time.perf_counter())
    except Exception as err:  # noqa: BLE001 (a failed request is a result, not a crash)
        return None, f"{type(err).__name__}: {err}"
    if not times:
        return None, "no tokens"
    return RequestTrace(submitted, tuple(times), planned.prompt_len), None


async def _run(url: str, planned: list[PlannedRequest], timeout: float):
    import httpx

    limits = httpx.Limits(max_connections=len(planned), max_keepalive_connections=0)
    async with httpx.AsyncClient(limits=limits) as client:
        models = await client.get(f"{url}/v1/models", timeout=timeout)
        models.raise_for_status()
        model = models.json()["data"][0]["id"]          # the name the server answers to
        start = time.perf_counter()
        results = await asyncio.gather(*(_one(client, url, start, p, timeout, model)
                                         for p in planned))
        return results, time.perf_counter() - start


def run_load(url: str, rate: float, n: int, *, ttft_slo: float = 1.0, tpot_slo: float = 0.1,
             mix: Sequence[tuple[int, int, int]] = DEFAULT_MIX, seed: int = 0,
             timeout: float = 300.0) -> dict:
    """Send n Poisson-arriving requests at `rate` per second to the server at `url`; returns
    {"rate", "requests", "ok", "failed" (reasons), "seconds", "output_tokens_per_s",
    "metrics" (tinygpt.bench.request_metrics of the successful requests, or None)}."""
    planned = plan_requests(n, rate, mix, seed)
    results, seconds = asyncio.run(_run(url.rstrip("/"), planned, timeout))
    traces = [t for t, _ in results if t is not None]
    failed = [why for t, why in results if t is None]
    tokens = sum(t.n_tokens for t in traces)
    return {"rate": rate, "requests": n, "ok": len(traces), "failed": failed,
            "seconds": seconds, "output_tokens_per_s": tokens / seconds,
            "goodput_rps": (request_metrics(traces, ttft_slo, tpot_slo)["slo_met"] / seconds
                            if traces else 0.0),
            "metrics": request_metrics(traces, ttft_slo, tpot_slo) if traces else None,
            "plan": [asdict(p) for p in planned]}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def user_environment() -> dict[str, str]:
    """This process's environment without the settings `python -m tinygpt bench` added for
    itself (tinygpt.__main__.ENV_DEFAULTS, listed in ENV_ADDED): the environment a user's own
    `python -m tinygpt serve` or `chat` would have."""
    from tinygpt.__main__ import ENV_ADDED

    added = set(filter(None, os.environ.get(ENV_ADDED, "").split(","))) | {ENV_ADDED}
    return {key: value for key, value in os.environ.items() if key not in added}


@contextmanager
def running_server(*args: str, timeout: float = 120.0, env: dict | None = None,
                   log: str | os.PathLike | None = None
                   ) -> Iterator[tuple[str, subprocess.Popen]]:
    """`python -m tinygpt serve --port <free> *args` in a subprocess; yields (its base URL,
    the process) once /health answers, and stops it with SIGTERM (then kill) on exit.
    RuntimeError, with the server's last output, if it exits or stays silent for `timeout`
    seconds. env: the server's environment (default: user_environment()). log: a file that
    gets the server's output (default: a temporary file, removed after).

    The output goes to a file, not to a pipe: uvicorn writes a line per request, and once a
    pipe that nobody reads holds 64 KiB (about 1,100 requests) the server blocks in that
    write, with every client waiting on it."""
    import httpx

    if env is None:
        env = user_environment()
    port = free_port()
    out = open(log, "w+b") if log is not None else tempfile.TemporaryFile()  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "tinygpt", "serve", "--port", str(port),
                             *args], stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                out.seek(0)
                text = out.read().decode(errors="replace")
                raise RuntimeError(f"the server did not start (exit {proc.poll()}):\n"
                                   f"{text[-2000:]}")
            time.sleep(0.2)
        yield url, proc
    finally:
        stop_server(proc)
        out.close()


def stop_server(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM to a server process (it finishes its requests), then kill after grace_s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def plot_goodput(reports: list[dict]):
    """Goodput and throughput against the offered rate (a matplotlib Figure, no pyplot)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    rates = [r["rate"] for r in reports]
    ax.plot(rates, rates, ":", color="gray", label="offered rate")
    ax.plot(rates, [r["goodput_rps"] for r in reports], "o-", label="goodput (met both SLOs)")
    ax.plot(rates, [r["ok"] / r["seconds"] for r in reports], "s--", label="completed / s")
    ax.set_xlabel("offered load (requests / s)")
    ax.set_ylabel("requests / s")
    ax.legend()
    fig.tight_layout()
    return fig


def format_reports(reports: list[dict]) -> str:
    lines = [f"{'rate':>6} {'ok':>5} {'tok/s':>8} {'goodput':>8} {'TTFT p50':>9} {'p99':>8} "
             f"{'ITL p50':>8} {'p99':>8}"]
    for r in reports:
        m = r["metrics"]
        cells = ["-"] * 4 if m is None else [
            f"{m['ttft_s']['p50'] * 1e3:.0f}ms", f"{m['ttft_s']['p99'] * 1e3:.0f}ms",
            *([f"{m['itl_s']['p50'] * 1e3:.1f}ms", f"{m['itl_s']['p99'] * 1e3:.1f}ms"]
              if m["itl_s"] else ["-", "-"])]
        lines.append(f"{r['rate']:>6g} {r['ok']:>3}/{r['requests']:<2}"
                     f"{r['output_tokens_per_s']:>8.1f} {r['goodput_rps']:>8.2f} "
                     f"{cells[0]:>9} {cells[1]:>8} {cells[2]:>8} {cells[3]:>8}")
    return "\n".join(lines)


def check_url(url: str) -> str:
    """`url` when it is an http:// or https:// address with a host (and a valid port, if any);
    a ValueError naming --url otherwise."""
    try:                                # a malformed IPv6 host, or a port that is not a
        parts = urllib.parse.urlsplit(url)      # number in 0 .. 65535
        ok = parts.scheme in ("http", "https") and bool(parts.hostname) and (
            parts.port is None or parts.port > 0)
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"--url must be an http:// or https:// address with a host, as "
                         f"http://127.0.0.1:8000; got {url!r}")
    return url


def parse_rates(text: str) -> list[float]:
    """--rates "1,2,4" -> [1.0, 2.0, 4.0]; each rate a finite number > 0 (a ValueError naming
    --rates otherwise)."""
    try:
        rates = [float(r) for r in text.split(",")]
    except ValueError:
        rates = []
    if not rates or not all(r > 0 and math.isfinite(r) for r in rates):
        raise ValueError(f"--rates must be comma-separated request rates per second, each a "
                         f"finite number > 0, as 1,2,4; got {text!r}")
    return rates


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of `python -m tinygpt bench serve`."""
    parser = argparse.ArgumentParser(prog="python -m tinygpt bench serve",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True,
                        help="the server, an http:// or https:// address, e.g. "
                             "http://127.0.0.1:8000")
    parser.add_argument("--rates", default="1,2,4", help="offered rates, requests/s (1,2,4)")
    parser.add_argument("--requests", type=int, default=32,
                        help=f"requests per rate, 1 .. {MAX_REQUESTS} (32); their arrivals over "
                             f"all the rates may be expected to take at most a day")
    parser.add_argument("--ttft-slo", type=float, default=1.0, help="TTFT SLO in s (1.0)")
    parser.add_argument("--tpot-slo", type=float, default=0.1, help="TPOT SLO in s (0.1)")
    parser.add_argument("--seed", type=int, default=0, help=f"0 .. {MAX_SEED} (0)")
    parser.add_argument("--json", metavar="PATH", default=None, help="write the reports as JSON")
    parser.add_argument("--plot", metavar="PATH", default=None,
                        help="save goodput vs rate (.png, .pdf, .svg, ...)")
    return parser


def check_args(args: argparse.Namespace) -> list[float]:
    """Every argument, before any request is sent; returns the rates. A ValueError naming the
    option and its allowed values otherwise."""
    from tinygpt.roofline import output_path

    check_url(args.url)
    rates = parse_rates(args.rates)
    if not 1 <= args.requests <= MAX_REQUESTS:
        raise ValueError(f"--requests must be an int in 1 .. {MAX_REQUESTS}, got "
                         f"{args.requests}")
    arrivals = sum(args.requests / rate for rate in rates)
    if arrivals > MAX_ARRIVALS_S:
        raise ValueError(f"--requests {args.requests} at --rates {args.rates} would take about "
                         f"{arrivals / 3600:,.3g} hours of arrivals (requests / rate, summed "
                         f"over the rates); at most {MAX_ARRIVALS_S // 3600}: lower --requests "
                         f"or raise --rates")
    if not 0 <= args.seed <= MAX_SEED:
        raise ValueError(f"--seed must be an int in 0 .. {MAX_SEED}, got {args.seed}")
    for name, value in (("--ttft-slo", args.ttft_slo), ("--tpot-slo", args.tpot_slo)):
        if not (value > 0 and math.isfinite(value)):
            raise ValueError(f"{name} must be a finite number of seconds > 0, got {value}")
    if args.json is not None:
        output_path(args.json, "--json")
    if args.plot is not None:
        output_path(args.plot, "--plot", plot=True)
    return rates


def main(argv: list[str] | None = None) -> int:
    """`python -m tinygpt bench serve --url URL [--rates 1,2,4] [--requests N] ...`; see
    build_parser(). Bad arguments exit with 2, a server that cannot be reached (or does not
    answer GET /v1/models) with 1, each with one `error: ...` line."""
    import httpx

    try:
        args = build_parser().parse_args(argv)
        rates = check_args(args)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    reports = []
    try:
        for rate in rates:
            print(f"rate {rate:g}/s: {args.requests} requests ...", file=sys.stderr, flush=True)
            reports.append(run_load(args.url, rate, args.requests, ttft_slo=args.ttft_slo,
                                    tpot_slo=args.tpot_slo, seed=args.seed))
    except httpx.TransportError as err:
        print(f"error: cannot reach {args.url}: {err}", file=sys.stderr)
        return 1
    except httpx.HTTPStatusError as err:
        print(f"error: {args.url} answered GET /v1/models with HTTP "
              f"{err.response.status_code}; is it `python -m tinygpt serve`?", file=sys.stderr)
        return 1
    print(format_reports(reports))
    if args.json is not None:
        Path(args.json).write_text(json.dumps(reports, indent=1))
    if args.plot is not None:
        plot_goodput(reports).savefig(args.plot, dpi=120, bbox_inches="tight")
    return 0 if all(not r["failed"] for r in reports) else 1


# ----------------------------------------------------------------------------------------------
# multi-turn chat: conversations that resend their history every turn

SYSTEM_PROMPT = ("You are a friendly storyteller for small children. You tell short, happy "
                 "stories about animals, parks, toys and families. You use simple words. Every "
                 "story has a beginning, a middle and a happy end, and nobody is ever hurt. ")
USER_TURNS = ("Tell me a story about a cat.", "What did the cat find in the garden?",
              "Who did the cat meet next?", "What did they eat for lunch?",
              "Where did they go after lunch?", "How did the day end?",
              "Tell me about the cat's best friend.", "What game did they play?")


async def _conversation(client, url: str, index: int, turns: int, period: float, start: float,
                        max_tokens: int, timeout: float, model: str) -> list[dict]:
    messages = [{"role": "system", "content": SYSTEM_PROMPT}]
    out = []
    for turn in range(turns):
        # turn t of conversation i is due at a fixed time: the same offered rate with or
        # without a prefix cache (a turn whose reply is late is sent when the reply is in)
        await asyncio.sleep(max(0.0, start + index * period / 4 + turn * period
                                - time.perf_counter()))
        messages.append({"role": "user", "content": USER_TURNS[(index + turn) % len(USER_TURNS)]})
        body = {"model": model, "messages": messages, "max_tokens": max_tokens,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        sent, first, pieces, usage = time.perf_counter(), None, [], None
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body,
                                 timeout=timeout) as response:
            if response.status_code != 200:
                raise RuntimeError(f"HTTP {response.status_code}: {await response.aread()!r}")
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk["choices"]:
                    text = choice["delta"].get("content")
                    if (text or choice["finish_reason"]) and first is None:
                        first = time.perf_counter()
                    pieces.append(text or "")
        reply = "".join(pieces)
        messages.append({"role": "assistant", "content": reply})
        out.append({"conversation": index, "turn": turn, "ttft_s": first - sent,
                    "e2e_s": time.perf_counter() - sent, "reply": reply,
                    "prompt_tokens": usage["prompt_tokens"] if usage else None})
    return out


def run_chat_sessions(url: str, conversations: int = 4, turns: int = 4, *,
                      period: float = 0.5, max_tokens: int = 16,
                      timeout: float = 120.0, model: str = "tinygpt") -> dict:
    """`conversations` chats of `turns` turns each against the server at `url`, all sharing
    SYSTEM_PROMPT; every turn resends the whole history (as chat clients do), greedy, and is
    due `period` seconds after the conversation's previous one; `model`: the served model's
    name. Returns {"requests": per
    request dicts (ttft_s, e2e_s, reply, prompt_tokens), "mean_ttft_s", "seconds",
    "prefill_tokens" (tokens the engine computed for the prompts: /health's admitted tokens
    minus those found in the prefix cache), "prompt_tokens", "hit_tokens"}."""
    import httpx

    url = url.rstrip("/")
    before = httpx.get(f"{url}/health").json()

    async def run():
        limits = httpx.Limits(max_connections=conversations)
        async with httpx.AsyncClient(limits=limits) as client:
            start = time.perf_counter()
            done = await asyncio.gather(*(_conversation(client, url, i, turns, period, start,
                                                        max_tokens, timeout, model)
                                          for i in range(conversations)))
            return [r for chat in done for r in chat], time.perf_counter() - start

    requests, seconds = asyncio.run(run())
    after = httpx.get(f"{url}/health").json()
    admitted = after["prefix_query_tokens"] - before["prefix_query_tokens"]
    hits = after["prefix_hit_tokens"] - before["prefix_hit_tokens"]
    return {"requests": requests, "seconds": seconds,
            "mean_ttft_s": sum(r["ttft_s"] for r in requests) / len(requests),
            "prompt_tokens": sum(r["prompt_tokens"] or 0 for r in requests),
            "prefill_tokens": admitted - hits, "hit_tokens": hits}


def run_concurrent_streams(url: str, prompts: list[list[int]], max_tokens: int,
                           timeout: float = 300.0, model: str = "tinygpt"
                           ) -> tuple[float, list[str]]:
    """Every prompt (token ids) as a greedy streaming completion at once (ignore_eos, so each
    runs max_tokens) to the served `model`; returns (seconds from the first send to the last
    token, the texts in the prompts' order)."""
    import httpx

    async def one(client, prompt):
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True}
        pieces = []
        async with client.stream("POST", f"{url.rstrip('/')}/v1/completions", json=body,
                                 timeout=timeout) as response:
            if response.status_code != 200:
                raise RuntimeError(f"HTTP {response.status_code}: {await response.aread()!r}")
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    pieces.extend(c["text"] for c in json.loads(line[6:])["choices"])
        return "".join(pieces)

    async def run():
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=len(prompts))) as c:
            start = time.perf_counter()
            texts = await asyncio.gather(*(one(c, p) for p in prompts))
            return time.perf_counter() - start, list(texts)

    return asyncio.run(run())
