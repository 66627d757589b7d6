"""The tinygpt command line: `python -m tinygpt {generate,chat,bench,roofline,serve} ...`.

Each subcommand lives in the module that owns the concept and exposes `main(argv) -> int`.
"""

from __future__ import annotations

import importlib
import os
import sys

COMMANDS = {
    "generate": ("tinygpt.generate", "generate text from the shipped checkpoint"),
    "chat": ("tinygpt.chat", "chat in the terminal (default: SmolLM2-135M-Instruct, offline)"),
    "bench": ("tinygpt.bench", "measure TTFT, TPOT, tokens/s and the course's speed targets"),
    "roofline": ("tinygpt.roofline", "estimate prefill/decode times on a roofline"),
    "serve": ("tinygpt.server", "serve a model over an OpenAI-compatible HTTP API"),
}

# Settings a command wants in the environment before torch loads (OpenMP reads them once, when
# its library loads). bench: OpenMP's worker threads spin between parallel regions instead of
# sleeping. A decode step runs about 50 short multi-threaded products one after another; waking
# sleeping workers for each one cost 13% of the products' time on the 2-core AVX-512 EPYC
# (2026-11-21). llama.cpp's thread pool spins in the same way. GOMP_SPINCOUNT bounds the
# spinning (about 200,000 pauses, a few milliseconds): unbounded, as ACTIVE alone makes it, a
# worker that ran one parallel region (a prefill, an argmax over the vocabulary) kept spinning
# through the whole decode that followed, half a core taken from tinygpt.cpu_kernels' product
# threads (measured per thread: 0.53-0.64 of a core against 0.18 bounded, AVX-512 EPYC,
# 2026-11-25). An explicit setting is never changed. The keys a command added are listed in
# ENV_ADDED, so that the processes it starts (the benchmarks' servers and chat:
# tinygpt.bench.load.user_environment) run in the environment the user gave it: a server's
# spinning OpenMP workers would take a core from its own product threads.
ENV_DEFAULTS = {"bench": {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "200000"}}
ENV_ADDED = "TINYGPT_ENV_ADDED"


def usage() -> str:
    lines = ["usage: python -m tinygpt COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines.append("\nRun `python -m tinygpt COMMAND --help` for a command's options.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"unknown command {name!r}; choose one of {sorted(COMMANDS)}\n", file=sys.stderr)
        print(usage(), file=sys.stderr)
        return 2
    if "torch" not in sys.modules:  # too late once torch (and its OpenMP runtime) has loaded
        added = [key for key in ENV_DEFAULTS.get(name, {}) if key not in os.environ]
        for key in added:
            os.environ[key] = ENV_DEFAULTS[name][key]
        if added:
            os.environ[ENV_ADDED] = ",".join(added)
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
