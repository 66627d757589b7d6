"""`python -m tinygpt serve`'s command line: the flags (build_parser), the default KV pool
(default_kv_blocks), and main, which checks the flags, loads the model, starts the engine
(batching, serial, or tensor-parallel over local ranks), builds the app and runs uvicorn until
SIGINT or SIGTERM. argparse reads the flags before torch, uvicorn and the app load, so `--help`
and a malformed flag (an unknown one, a value that is not a number) answer at once; values out
of range (a negative --port, --max-running 0) are reported after torch has loaded."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

from tinygpt.server.protocol import (
    BODY_TIMEOUT_S,
    HEADER_TIMEOUT_S,
    KEEP_ALIVE_S,
    KV_POOL_BYTES,
    MAX_BODY_BYTES,
)


def default_kv_blocks(cfg, max_running: int, model_id: str, block_size: int = 16,
                      budget_bytes: int = KV_POOL_BYTES) -> int:
    """The KV pool when --kv-blocks is not given: room for max_running sequences of
    min(context, 512) positions (the engine's default), capped at budget_bytes of float32 K
    and V; prints a note when capped (SmolLM2-135M: the default 32 sequences of 512 positions
    at 46,080 bytes a position would otherwise ask for 755 MB)."""
    per_position = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 4
    wanted = max_running * -(-min(cfg.max_seq_len, 512) // block_size)
    cap = max(1, budget_bytes // (per_position * block_size))
    if wanted <= cap:
        return wanted
    print(f"note: {model_id}: context {cfg.max_seq_len} positions; KV pool capped at {cap} "
          f"blocks of {block_size} = {cap * block_size} positions "
          f"({cap * block_size * per_position / 2**20:.0f} MiB); --kv-blocks N to change",
          file=sys.stderr, flush=True)
    return cap


# --quantize NAME -> the tinygpt.quant scheme it serves
QUANTIZE = {"int8": "int8", "int4": "int4-g32"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tinygpt serve",
        description="Serve a TinyGPT checkpoint over an OpenAI-compatible HTTP API.")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    parser.add_argument("--model", default=None,
                        help="tinygpt (the shipped checkpoint, default), tinygpt-moe (day "
                             "20's mixture of experts), smollm2 (the installed "
                             "SmolLM2-135M-Instruct), a .gguf file, a TinyGPT checkpoint "
                             "folder or a Hugging Face folder (Llama, Mistral, Qwen3-MoE, Mixtral, "
                             "DeepSeek-V3)")
    parser.add_argument("--max-queue", type=int, default=64,
                        help="requests that may wait; one more gets 429 (default 64)")
    parser.add_argument("--grace", type=float, default=5.0,
                        help="seconds running requests get to finish on shutdown (default 5)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--engine", choices=("batch", "serial"), default="batch",
                        help="batch: continuous batching on a paged KV cache (default); serial: "
                             "one request at a time (the reference)")
    parser.add_argument("--max-running", type=int, default=32,
                        help="sequences in the batch at once (default 32)")
    parser.add_argument("--token-budget", type=int, default=256,
                        help="tokens one step may feed; long prompts are prefilled in chunks "
                             "(default 256)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="split the model over N local ranks (tinygpt.parallel; gloo ranks, "
                             "CPU only); N must divide the heads (default 1)")
    parser.add_argument("--kv-blocks", type=int, default=None,
                        help=f"KV-cache blocks of 16 positions (default: room for "
                             f"--max-running sequences of 512 positions, at most "
                             f"{KV_POOL_BYTES // 2**20} MiB)")
    parser.add_argument("--no-prefix-caching", action="store_true",
                        help="do not keep the KV blocks of earlier prompts for reuse")
    parser.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES,
                        help=f"the largest request body; a larger one gets 413 (default "
                             f"{MAX_BODY_BYTES})")
    parser.add_argument("--body-timeout", type=float, default=BODY_TIMEOUT_S,
                        help=f"seconds a request body may take to arrive; then 408 (default "
                             f"{BODY_TIMEOUT_S:g})")
    parser.add_argument("--header-timeout", type=float, default=HEADER_TIMEOUT_S,
                        help=f"seconds a connection may take to send its request headers; "
                             f"then it is closed (default {HEADER_TIMEOUT_S:g})")
    parser.add_argument("--device", default="cpu",
                        help="where the model runs: cpu (default), cuda or mps; off the CPU "
                             "the engine runs the model's own modules (the runner's plain "
                             "road)")
    parser.add_argument("--quantize", choices=tuple(QUANTIZE), default=None,
                        help="serve weight-only quantized weights: int8 (per row) or int4 "
                             "(groups of 32), see tinygpt.quant (default: as loaded)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """`python -m tinygpt serve [--host H] [--port N] [--model PATH] ...`"""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    import torch
    import uvicorn

    import tinygpt
    from tinygpt.engine import AsyncEngine, SerialEngine
    from tinygpt.loading import load_model
    from tinygpt.server.app import create_app
    from tinygpt.server.limits import timed_h11

    problems = []
    if not 0 <= args.port <= 65535:
        problems.append(f"--port must be in [0, 65535], got {args.port}")
    if args.max_queue < 0:
        problems.append(f"--max-queue must be >= 0, got {args.max_queue}")
    if not args.grace >= 0:
        problems.append(f"--grace must be >= 0 seconds, got {args.grace}")
    if args.threads is not None and args.threads < 1:
        problems.append(f"--threads must be >= 1, got {args.threads}")
    for flag, value in (("--max-running", args.max_running),
                        ("--tensor-parallel-size", args.tensor_parallel_size),
                        ("--token-budget", args.token_budget), ("--kv-blocks", args.kv_blocks),
                        ("--max-body-bytes", args.max_body_bytes)):
        if value is not None and value < 1:
            problems.append(f"{flag} must be >= 1, got {value}")
    for flag, value in (("--body-timeout", args.body_timeout),
                        ("--header-timeout", args.header_timeout)):
        if not value > 0:
            problems.append(f"{flag} must be > 0 seconds, got {value}")
    if args.tensor_parallel_size > 1 and args.engine == "serial":
        problems.append("--tensor-parallel-size > 1 runs the batching engine; drop --engine "
                        "serial")
    try:
        device = tinygpt.usable_device(args.device)
    except ValueError as err:
        problems.append(str(err))
        device = None
    if device is not None and device.type != "cpu" and (
            args.quantize is not None or args.tensor_parallel_size > 1):
        problems.append(f"--device {args.device} serves the full-precision model in one "
                        f"process; --quantize and --tensor-parallel-size > 1 are for the CPU")
    if problems:
        print("error: " + "; ".join(problems), file=sys.stderr)
        return 2
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        model, tokenizer, info = load_model(args.model)
    except (OSError, ValueError) as err:
        print(f"error: cannot load the model: {err}", file=sys.stderr)
        return 2
    model = model.to(device)
    if args.kv_blocks is None and args.engine == "batch":
        args.kv_blocks = default_kv_blocks(model.cfg, args.max_running, info.model_id)
    if args.quantize is not None:
        from tinygpt.quant import quantize_model

        try:             # e.g. a mixture of experts: its experts are not nn.Linear layers
            model = quantize_model(model.eval(), QUANTIZE[args.quantize])
        except ValueError as err:
            print(f"error: --quantize {args.quantize}: {err}", file=sys.stderr)
            return 2
    if args.tensor_parallel_size > 1:
        import functools

        from tinygpt.parallel import start_tensor_parallel

        if args.quantize is not None:
            print("error: --tensor-parallel-size > 1 shards a full-precision model; drop "
                  "--quantize", file=sys.stderr)
            return 2
        try:
            engine = start_tensor_parallel(
                model.eval(), tokenizer, functools.partial(load_model, args.model),
                args.tensor_parallel_size, max_waiting=args.max_queue,
                max_running=args.max_running, token_budget=args.token_budget,
                num_blocks=args.kv_blocks)
        except ValueError as err:
            print(f"error: --tensor-parallel-size {args.tensor_parallel_size}: {err}",
                  file=sys.stderr)
            return 2
    elif args.engine == "serial":
        engine = SerialEngine(model.eval(), tokenizer, max_waiting=args.max_queue)
    else:
        engine = AsyncEngine(model.eval(), tokenizer, max_waiting=args.max_queue,
                             max_running=args.max_running, token_budget=args.token_budget,
                             num_blocks=args.kv_blocks,
                             prefix_caching=not args.no_prefix_caching)
    app = create_app(engine, tokenizer, model.cfg.max_seq_len, grace_s=args.grace,
                     max_body_bytes=args.max_body_bytes, body_timeout_s=args.body_timeout,
                     model_id=info.model_id, eos_ids=info.eos_ids,
                     end_of_turn_ids=info.end_of_turn_ids)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="info",
                            timeout_graceful_shutdown=round(args.grace) + 5,
                            loop="asyncio", http=timed_h11(args.header_timeout),
                            timeout_keep_alive=KEEP_ALIVE_S,
                            h11_max_incomplete_event_size=64 * 1024)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            # wind the engine down at once: running requests get the grace period, then end
            # their streams with an error event, before uvicorn closes the connections
            loop = asyncio.get_event_loop()
            loop.call_soon_threadsafe(lambda: loop.create_task(engine.shutdown(args.grace)))
            super().handle_exit(sig, frame)

    server = Server(config)
    print(f"serving {info.model_id} ({sum(p.numel() for p in model.parameters()):,} parameters) on "
          f"http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    # uvicorn shuts down gracefully on SIGINT / SIGTERM and then re-raises the signal to the
    # handler that was there before it; this one turns that into a clean exit with status 0.
    stopped: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda number, _frame: stopped.append(number))
    server.run()
    if stopped:
        print(f"stopped on {signal.Signals(stopped[0]).name}", file=sys.stderr)
    return 0 if server.started else 1
