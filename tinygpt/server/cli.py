"""`python -m tinygpt serve`'s command line: the flags (build_parser), the default KV pool
(default_kv_blocks) and its smallest size (min_kv_blocks), and main, which checks the flags
(check_flags), binds the address (bind), then (serve) loads the model, starts the engine
(batching, serial, or tensor-parallel over local ranks), builds the app, announces the address
with the port it got and runs uvicorn on the bound socket until SIGINT or SIGTERM.

argparse reads the flags before torch, uvicorn and the app load, so `--help` and a malformed
flag (an unknown one, a value that is not a number) answer at once; values out of range (a
negative --port, --max-running 0, a --token-budget below --max-running, an infinite --grace,
more --threads than tinygpt.thread_count allows, an empty --host) and flags the serial engine
would ignore are reported after torch has loaded, before the model does: one `error:` line,
exit 2. An address that cannot be bound (a port in use, a host that does not resolve) is exit
1, also before the model loads. Only --kv-blocks waits for the model: below min_kv_blocks (its
chat template sets the minimum) or above what the memory holds (its layers and heads set the
bytes of a block), it is exit 2 before the engine starts, as is a pool the allocator cannot
give."""

from __future__ import annotations

import argparse
import asyncio
import errno
import math
import os
import signal
import socket
import sys

from tinygpt.server.protocol import (
    BODY_TIMEOUT_S,
    COMPLETION_MAX_TOKENS,
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


def kv_block_bytes(model, block_size: int = 16) -> int:
    """Bytes one KV block of `model` takes, shaped as tinygpt.paged.PagedKVCache.for_model
    shapes its pool: K and V of every layer and KV head (one shared latent per layer for
    day 21's multi-head latent attention), in the model's dtype."""
    cfg = model.cfg
    size = next(model.parameters()).element_size()
    if cfg.attention == "mla":
        return cfg.n_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * block_size * size
    return 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * block_size * size


def memory_bytes(device) -> int:
    """What a KV pool on `device` can at most take: a CUDA device's own memory, else this
    machine's physical memory."""
    if device.type == "cuda":
        import torch

        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def allocation_failed(err: BaseException) -> bool:
    """Whether `err` is torch or Python running out of memory (torch's CPU allocator raises a
    plain RuntimeError that says it cannot allocate)."""
    import torch

    return isinstance(err, MemoryError | torch.OutOfMemoryError) or (
        isinstance(err, RuntimeError) and "can't allocate memory" in str(err))


# --quantize NAME -> the tinygpt.quant scheme it serves
QUANTIZE = {"int8": "int8", "int4": "int4-g32"}
MAX_RUNNING, TOKEN_BUDGET = 32, 256      # --max-running's and --token-budget's defaults


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tinygpt serve",
        description="Serve a TinyGPT checkpoint over an OpenAI-compatible HTTP API.")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1: this machine only; "
                             "0.0.0.0 for every interface)")
    parser.add_argument("--port", type=int, default=8000,
                        help="port (default 8000; 0: a free one, announced at start)")
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
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads: 1 to 4 per usable core (default: torch's); with "
                             "--tensor-parallel-size N, per rank (default: usable cores / N)")
    parser.add_argument("--engine", choices=("batch", "serial"), default="batch",
                        help="batch: continuous batching on a paged KV cache (default); serial: "
                             "one request at a time (the reference)")
    # the batching engine's flags default to None, so that main knows which were given (the
    # serial engine refuses them); main fills in MAX_RUNNING and TOKEN_BUDGET
    parser.add_argument("--max-running", type=int, default=None,
                        help=f"sequences in the batch at once (default {MAX_RUNNING})")
    parser.add_argument("--token-budget", type=int, default=None,
                        help=f"tokens one step may feed, at least --max-running; long prompts "
                             f"are prefilled in chunks (default {TOKEN_BUDGET})")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="split the model over N local ranks (tinygpt.parallel; gloo ranks, "
                             "CPU only); N must divide the heads (default 1)")
    parser.add_argument("--kv-blocks", type=int, default=None,
                        help=f"KV-cache blocks of 16 positions, at least room for the model's "
                             f"chat template and a {COMPLETION_MAX_TOKENS}-token reply, at most "
                             f"what the memory (the GPU's with --device cuda) holds "
                             f"(default: room for --max-running sequences of 512 positions, "
                             f"at most {KV_POOL_BYTES // 2**20} MiB)")
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


def check_flags(args: argparse.Namespace) -> list[str]:
    """What is wrong with the flags, one message per problem (empty: nothing); fills in the
    defaults of --max-running and --token-budget. Needs nothing loaded but tinygpt itself
    (--device is checked in main, with torch)."""
    import tinygpt

    problems = []
    if not args.host.strip():
        problems.append(f"--host must name an address (127.0.0.1: this machine only, 0.0.0.0: "
                        f"every interface), got {args.host!r}")
    if not 0 <= args.port <= 65535:
        problems.append(f"--port must be in [0, 65535], got {args.port}")
    if args.max_queue < 1:
        problems.append(f"--max-queue must be >= 1 (0 would refuse every request), got "
                        f"{args.max_queue}")
    if not (args.grace >= 0 and math.isfinite(args.grace)):
        problems.append(f"--grace must be a finite number of seconds >= 0, got {args.grace}")
    if args.threads is not None:
        try:
            tinygpt.thread_count(args.threads, "--threads")
        except ValueError as err:
            problems.append(str(err))
    if args.engine == "serial":
        given = [flag for flag, value in (("--max-running", args.max_running),
                                          ("--token-budget", args.token_budget),
                                          ("--kv-blocks", args.kv_blocks)) if value is not None]
        given += ["--no-prefix-caching"] if args.no_prefix_caching else []
        if given:
            problems.append(f"--engine serial has no batch, KV pool or prefix cache: drop "
                            f"{', '.join(given)} (or use --engine batch)")
    if args.max_running is None:
        args.max_running = MAX_RUNNING
    if args.token_budget is None:
        args.token_budget = TOKEN_BUDGET
    for flag, value in (("--max-running", args.max_running),
                        ("--tensor-parallel-size", args.tensor_parallel_size),
                        ("--token-budget", args.token_budget), ("--kv-blocks", args.kv_blocks),
                        ("--max-body-bytes", args.max_body_bytes)):
        if value is not None and value < 1:
            problems.append(f"{flag} must be >= 1, got {value}")
    if args.token_budget < args.max_running:
        problems.append(f"--token-budget ({args.token_budget}) must be >= --max-running "
                        f"({args.max_running}): each running sequence feeds one token a step")
    for flag, value in (("--body-timeout", args.body_timeout),
                        ("--header-timeout", args.header_timeout)):
        if not (value > 0 and math.isfinite(value)):
            problems.append(f"{flag} must be a finite number of seconds > 0, got {value}")
    if args.tensor_parallel_size > 1 and args.engine == "serial":
        problems.append("--tensor-parallel-size > 1 runs the batching engine; drop --engine "
                        "serial")
    return problems


def min_kv_blocks(tokenizer, block_size: int = 16) -> int:
    """The smallest pool --kv-blocks may ask for: room for one request a client sends with the
    defaults, the model's chat template around a one-word message (the word alone for a model
    without a template: it serves completions only) and a reply of COMPLETION_MAX_TOKENS tokens
    (/v1/completions' default). The server admits requests up to the pool's positions when that
    is fewer than the context (see tinygpt.server.prompts), so a smaller pool would refuse such
    a request, or cut its default reply short."""
    try:
        prompt = len(tokenizer.encode_chat([{"role": "user", "content": "Hi"}]))
    except ValueError:          # no chat template: /v1/chat/completions answers 400
        # the word, and the BOS the server puts before a prompt where the tokenizer says one
        # goes (tinygpt.server.prompts.Prompts.bos_prefix)
        bos = getattr(tokenizer, "add_bos", False) and getattr(tokenizer, "bos_id", None)
        prompt = len(tokenizer.encode("Hi")) + int(bos is not None and bos is not False)
    return -(-(prompt + COMPLETION_MAX_TOKENS - 1) // block_size)


def kv_pool_too_large(blocks: int, block_bytes: int, memory: int, device) -> str:
    """serve's error line for a --kv-blocks pool larger than the memory of `device`."""
    where = f"{device}'s memory" if device.type == "cuda" else "this machine's memory"
    return (f"error: --kv-blocks {blocks} asks for {blocks * block_bytes / 2**30:,.1f} GiB of "
            f"KV cache ({block_bytes:,} bytes a block), more than {where} "
            f"({memory / 2**30:,.1f} GiB): at most {memory // block_bytes:,} blocks")


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port) and listening (uvicorn serves it; connections made
    while the model loads wait in its backlog); an OSError whose message names the flag at
    fault: --host for an address that does not resolve or is not this machine's, --port for
    one in use or reserved."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as uvicorn does
    try:
        sock.bind((host, port))
        sock.listen()     # now, so that a second server on this port fails here too
    except OSError as err:
        sock.close()
        reason = err.strerror or str(err)
        if isinstance(err, socket.gaierror):
            raise OSError(f"--host {host}: no such address ({reason})") from None
        if err.errno == errno.EADDRNOTAVAIL:
            raise OSError(f"--host {host}: not an address of this machine ({reason})") from None
        if err.errno in (errno.EADDRINUSE, errno.EACCES):
            raise OSError(f"--port {port}: {reason}" + (
                " (another server is listening there?)" if err.errno == errno.EADDRINUSE
                else " (ports below 1024 need privileges)")) from None
        raise OSError(f"--host {host} --port {port}: {reason}") from None
    return sock


def main(argv: list[str] | None = None) -> int:
    """`python -m tinygpt serve [--host H] [--port N] [--model PATH] ...`: 2 for bad flags or a
    model that cannot be served, 1 when the address cannot be bound, 0 after SIGINT/SIGTERM."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    import torch

    import tinygpt

    problems = check_flags(args)
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
    try:                 # before the model loads: an address in use fails at once
        sock = bind(args.host, args.port)
    except OSError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    with sock:
        if args.threads is not None:
            torch.set_num_threads(args.threads)
        return serve(args, device, sock)


def serve(args: argparse.Namespace, device, sock: socket.socket) -> int:
    """main's second half, on checked flags and a bound socket: load the model, start the
    engine and the app, announce the address and run uvicorn until SIGINT or SIGTERM."""
    import uvicorn

    from tinygpt.engine import AsyncEngine, SerialEngine
    from tinygpt.loading import load_model
    from tinygpt.server.app import create_app
    from tinygpt.server.limits import guarded_h11

    try:
        model, tokenizer, info = load_model(args.model)
    except (OSError, ValueError) as err:
        print(f"error: cannot load the model: {err}", file=sys.stderr)
        return 2
    model = model.to(device)
    # counted before --quantize, which turns the weights it quantizes into buffers
    parameters = sum(p.numel() for p in model.parameters())
    if args.engine == "batch":
        if args.kv_blocks is None:
            args.kv_blocks = default_kv_blocks(model.cfg, args.max_running, info.model_id)
        least = min_kv_blocks(tokenizer)
        if args.kv_blocks < least:
            print(f"error: --kv-blocks {args.kv_blocks} is too small for {info.model_id}: at "
                  f"least {least} blocks of 16 positions hold its chat template around a "
                  f"one-word message and a {COMPLETION_MAX_TOKENS}-token reply",
                  file=sys.stderr)
            return 2
        block_bytes, memory = kv_block_bytes(model), memory_bytes(device)
        if args.kv_blocks * block_bytes > memory:
            print(kv_pool_too_large(args.kv_blocks, block_bytes, memory, device),
                  file=sys.stderr)
            return 2
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
                num_blocks=args.kv_blocks, prefix_caching=not args.no_prefix_caching,
                threads=args.threads)
        except ValueError as err:
            print(f"error: --tensor-parallel-size {args.tensor_parallel_size}: {err}",
                  file=sys.stderr)
            return 2
        except RuntimeError as err:     # the ranks could not form their group
            print(f"error: --tensor-parallel-size {args.tensor_parallel_size}: {err}",
                  file=sys.stderr)
            return 1
    elif args.engine == "serial":
        engine = SerialEngine(model.eval(), tokenizer, max_waiting=args.max_queue)
    else:
        try:
            engine = AsyncEngine(model.eval(), tokenizer, max_waiting=args.max_queue,
                                 max_running=args.max_running, token_budget=args.token_budget,
                                 num_blocks=args.kv_blocks,
                                 prefix_caching=not args.no_prefix_caching)
        except (MemoryError, RuntimeError) as err:
            if not allocation_failed(err):
                raise
            print(f"error: --kv-blocks {args.kv_blocks}: the KV pool of "
                  f"{args.kv_blocks * block_bytes / 2**30:,.1f} GiB could not be allocated "
                  f"({type(err).__name__}); give fewer blocks", file=sys.stderr)
            return 2
    app = create_app(engine, tokenizer, model.cfg.max_seq_len, grace_s=args.grace,
                     max_body_bytes=args.max_body_bytes, body_timeout_s=args.body_timeout,
                     model_id=info.model_id, eos_ids=info.eos_ids,
                     end_of_turn_ids=info.end_of_turn_ids)

    def refused(status: int) -> None:        # answered by the protocol, before the app
        app.state.served.metrics.count("other", status)

    protocol = guarded_h11(args.header_timeout, on_refused=refused)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="info",
                            timeout_graceful_shutdown=round(args.grace) + 5,
                            loop="asyncio", http=protocol,
                            timeout_keep_alive=KEEP_ALIVE_S)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            # wind the engine down at once: running requests get the grace period, then end
            # their streams with an error event, before uvicorn closes the connections
            loop = asyncio.get_event_loop()
            loop.call_soon_threadsafe(lambda: loop.create_task(engine.shutdown(args.grace)))
            super().handle_exit(sig, frame)

    server = Server(config)
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"serving {info.model_id} ({parameters:,} parameters) on "
          f"http://{host}:{sock.getsockname()[1]}/v1", file=sys.stderr, flush=True)
    # uvicorn shuts down gracefully on SIGINT / SIGTERM and then re-raises the signal to the
    # handler that was there before it; this one turns that into a clean exit with status 0.
    stopped: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda number, _frame: stopped.append(number))
    server.run(sockets=[sock])
    if stopped:
        print(f"stopped on {signal.Signals(stopped[0]).name}", file=sys.stderr)
    return 0 if server.started else 1
