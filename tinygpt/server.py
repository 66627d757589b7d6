"""`python -m tinygpt serve`: an OpenAI-compatible HTTP server over a tinygpt engine.

    python -m tinygpt serve --port 8000          # the shipped checkpoint on 127.0.0.1:8000

    POST /v1/completions       prompt (text, or a list of token ids) -> text; stream: true
                               sends server-sent events, then "data: [DONE]"
    POST /v1/chat/completions  messages -> the assistant's reply, through day 02's chat template
    GET  /v1/models            the one model, under its own id ("tinygpt", "SmolLM2-135M-Instruct")
    GET  /health               {"status": "ok", ...engine counts}
    GET  /metrics              Prometheus text: requests, tokens, running / waiting, TTFT, ITL

Built on FastAPI and uvicorn. Every error is an OpenAI-style JSON body {"error": {"message",
"type", "param", "code"}}: 400 for malformed JSON, values out of range, unsupported fields and
prompts or max_tokens that do not fit the context; 422 for a field of the wrong type; 404 for
an unknown model or path; 429 when the engine's queue is full; 503 while shutting down. A bad
request never disturbs the others. A streaming client that disconnects has its request
cancelled at once. On SIGTERM uvicorn stops accepting connections, running requests get
`--grace` seconds to finish, and the rest are cancelled.

The engine (tinygpt/engine.py) is AsyncEngine by default: continuous batching on a paged KV
cache (--max-running, --token-budget, --kv-blocks); `--engine serial` serves one request at a
time (the reference). /metrics adds the pool's blocks in use and the preemptions.
Sampling knobs map to tinygpt.sampling.SamplingParams: temperature, top_p, seed,
stop, presence_penalty, frequency_penalty, max_tokens (-> max_new_tokens), and the vLLM-style
extensions top_k, min_p and ignore_eos (generate past the end-of-text token).
"""

import argparse
import asyncio
import json
import re
import signal
import sys
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any

MODEL_ID = "tinygpt"
MAX_STOP_STRINGS = 4
KV_POOL_BYTES = 256 * 2**20       # the default KV pool's ceiling (see default_kv_blocks)


class APIError(Exception):
    """An error answered as OpenAI does: status code and an {"error": {...}} body."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = (status, message, param,
                                                                      kind, code)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


def _models():
    """The request bodies (pydantic), built on first use so importing tinygpt stays light."""
    from pydantic import BaseModel, ConfigDict

    class Common(BaseModel):
        model_config = ConfigDict(extra="allow")
        model: str
        max_tokens: int | None = None
        temperature: float = 1.0
        top_p: float = 1.0
        top_k: int = 0
        min_p: float = 0.0
        stop: str | list[str] | None = None
        stream: bool = False
        stream_options: dict | None = None
        seed: int | None = None
        presence_penalty: float = 0.0
        frequency_penalty: float = 0.0
        n: int = 1
        user: str | None = None
        ignore_eos: bool = False

    class CompletionBody(Common):
        prompt: str | list[str] | list[int]

    class Message(BaseModel):
        model_config = ConfigDict(extra="allow")
        role: str
        content: str

    class ChatBody(Common):
        messages: list[Message]
        max_completion_tokens: int | None = None

    return CompletionBody, ChatBody


def sampling_params(body, max_tokens: int):
    """SamplingParams from a request body; APIError 400 naming the field when out of range."""
    from tinygpt.sampling import SamplingParams

    stop = body.stop
    stop = () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop)
    if len(stop) > MAX_STOP_STRINGS:
        raise APIError(400, f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}",
                       param="stop")
    if not 0 < body.top_p <= 1:
        raise APIError(400, f"top_p must be in (0, 1], got {body.top_p}", param="top_p")
    for name in ("presence_penalty", "frequency_penalty"):
        if not -2 <= getattr(body, name) <= 2:
            raise APIError(400, f"{name} must be in [-2, 2], got {getattr(body, name)}",
                           param=name)
    try:
        return SamplingParams(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                              min_p=body.min_p, presence_penalty=body.presence_penalty,
                              frequency_penalty=body.frequency_penalty,
                              max_new_tokens=max_tokens, stop=stop, seed=body.seed)
    except (TypeError, ValueError) as err:
        words = re.findall(r"[a-z_]+", str(err))
        param = words[0] if words else None
        param = "max_tokens" if param == "max_new_tokens" else param
        raise APIError(400, str(err).replace("max_new_tokens", "max_tokens"),
                       param=param) from None


def _check_common(body, fields: set[str], model_id: str = MODEL_ID) -> None:
    unknown = sorted(set(body.model_extra or {}))
    if unknown:
        raise APIError(400, f"unsupported field(s) {unknown}; this server supports "
                            f"{sorted(fields)}", param=unknown[0])
    if body.model != model_id:
        raise APIError(404, f"the model {body.model!r} does not exist; this server serves "
                            f"{model_id!r}", param="model", code="model_not_found")
    if body.n != 1:
        raise APIError(400, f"n must be 1 (one choice per request), got {body.n}", param="n")


def _fit_context(prompt_len: int, max_tokens: int | None, context: int) -> int:
    if prompt_len == 0:
        raise APIError(400, "the prompt is empty: give at least one token", param="prompt")
    if prompt_len >= context:
        raise APIError(400, f"the prompt has {prompt_len} tokens; the model's context is "
                            f"{context}, so a prompt may have at most {context - 1}",
                       param="prompt", code="context_length_exceeded")
    if max_tokens is None:
        return min(16, context - prompt_len)
    if max_tokens < 1:
        raise APIError(400, f"max_tokens must be >= 1, got {max_tokens}", param="max_tokens")
    if prompt_len + max_tokens > context:
        raise APIError(400, f"max_tokens too large: the prompt's {prompt_len} tokens plus "
                            f"max_tokens {max_tokens} exceed the model's context of {context} "
                            f"(at most {context - prompt_len})", param="max_tokens",
                       code="context_length_exceeded")
    return max_tokens


def create_app(engine, tokenizer, context: int, *, grace_s: float = 5.0,
               model_id: str = MODEL_ID, eos_ids=None, end_of_turn_ids=None):
    """The FastAPI app over `engine` (SerialEngine's interface) and `tokenizer` (encode,
    decode, encode_chat, special_tokens); `context`: the model's max_seq_len. model_id: the
    name served. eos_ids end a completion, end_of_turn_ids a chat reply (default: the
    tokenizer's "<|endoftext|>", and "<|end|>" then it; see tinygpt.loading.ModelInfo)."""
    import prometheus_client as prom
    from fastapi import FastAPI
    from fastapi import Request as HTTPRequest
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.exceptions import HTTPException

    from tinygpt.engine import EngineClosed, EngineFull, latency_samples

    CompletionBody, ChatBody = _models()
    registry = prom.CollectorRegistry()
    http_requests = prom.Counter("tinygpt_http_requests", "HTTP requests by path and status",
                                 ["path", "status"], registry=registry)
    finished = prom.Counter("tinygpt_requests_finished", "generation requests by finish reason",
                            ["reason"], registry=registry)
    tokens = prom.Counter("tinygpt_generated_tokens", "tokens generated", registry=registry)
    ttft_hist = prom.Histogram("tinygpt_time_to_first_token_seconds", "TTFT (queue included)",
                               registry=registry)
    itl_hist = prom.Histogram("tinygpt_inter_token_latency_seconds", "gap between tokens",
                              buckets=(.001, .002, .005, .01, .02, .05, .1, .2, .5, 1, 2),
                              registry=registry)
    prom.Gauge("tinygpt_requests_running", "requests generating now", registry=registry
               ).set_function(lambda: engine.stats().running)
    prom.Gauge("tinygpt_requests_waiting", "requests waiting for the engine", registry=registry
               ).set_function(lambda: engine.stats().waiting)
    prom.Gauge("tinygpt_kv_blocks_used", "KV-cache blocks in use", registry=registry
               ).set_function(lambda: engine.stats().kv_blocks_used)
    prom.Gauge("tinygpt_kv_blocks_total", "KV-cache blocks in the pool", registry=registry
               ).set_function(lambda: engine.stats().kv_blocks_total)
    prom.Gauge("tinygpt_preemptions", "sequences preempted so far", registry=registry
               ).set_function(lambda: engine.stats().preemptions)

    queue_hist = prom.Histogram("tinygpt_queue_seconds", "time waiting before the engine ran "
                                "the request", registry=registry)

    def observe(request) -> None:           # the engine calls this when a request ends
        finished.labels(request.finish_reason or "unknown").inc()
        if request.queue_time is not None:
            queue_hist.observe(request.queue_time)
        tokens.inc(len(request.token_times))
        first, gaps = latency_samples(request)
        if first is not None:
            ttft_hist.observe(first)
        for gap in gaps:
            itl_hist.observe(gap)

    engine.on_finish = observe
    specials = getattr(tokenizer, "special_tokens", {})
    eos = list(eos_ids) if eos_ids is not None else \
        [specials[t] for t in ("<|endoftext|>",) if t in specials]
    end_of_turn = list(end_of_turn_ids) if end_of_turn_ids is not None else \
        [specials[t] for t in ("<|end|>",) if t in specials] + eos
    vocab = getattr(getattr(engine.model, "cfg", None), "vocab_size", 1 << 31)
    fields_completion = set(CompletionBody.model_fields)
    fields_chat = set(ChatBody.model_fields)

    @asynccontextmanager
    async def lifespan(app):
        yield
        await engine.shutdown(grace_s)

    app = FastAPI(title="tinygpt", lifespan=lifespan, docs_url=None, redoc_url=None)

    @app.middleware("http")
    async def count(request: HTTPRequest, call_next):
        response = await call_next(request)
        known = request.url.path if request.url.path in ("/v1/completions",
                                                         "/v1/chat/completions", "/v1/models",
                                                         "/health", "/metrics") else "other"
        http_requests.labels(known, str(response.status_code)).inc()
        return response

    @app.exception_handler(APIError)
    async def api_error(_, err: APIError):
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(_, err: RequestValidationError):
        errors = err.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            api = APIError(400, f"the body is not valid JSON: {first.get('msg')}")
        else:
            where = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
            api = APIError(422, f"{where}: {first.get('msg')}" if where else str(first.get(
                "msg")), param=where)
        return JSONResponse(api.body(), status_code=api.status)

    @app.exception_handler(HTTPException)
    async def http_error(_, err: HTTPException):
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        return JSONResponse(APIError(err.status_code, str(err.detail), kind=kind).body(),
                            status_code=err.status_code)

    @app.get("/health")
    async def health():
        return {"status": "ok", **vars(engine.stats())}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(prom.generate_latest(registry).decode(),
                                 media_type=prom.CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_id, "object": "model",
                                            "created": 0, "owned_by": "tinygpt"}]}

    async def submit(prompt_ids: list[int], params, eos_ids: list[int]):
        try:
            return await engine.submit(prompt_ids, params, eos_ids)
        except EngineFull as err:
            raise APIError(429, str(err), kind="rate_limit_error",
                           code="queue_full") from None
        except EngineClosed as err:
            raise APIError(503, str(err), kind="service_unavailable") from None
        except (TypeError, ValueError) as err:     # what the engine itself cannot take
            raise APIError(400, str(err)) from None

    def run(request, prompt_len: int, chat: bool, include_usage: bool):
        stamp, ident = int(time.time()), f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        kind = "chat.completion" if chat else "text_completion"

        def chunk(text: str | None, finish: str | None, first: bool = False) -> dict:
            if chat:
                delta = {"role": "assistant", "content": ""} if first else (
                    {"content": text} if text else {})
                choice = {"index": 0, "delta": delta, "finish_reason": finish}
                return {"id": ident, "object": "chat.completion.chunk", "created": stamp,
                        "model": model_id, "choices": [choice]}
            return {"id": ident, "object": "text_completion", "created": stamp,
                    "model": model_id, "choices": [{"index": 0, "text": text or "",
                                                    "finish_reason": finish,
                                                    "logprobs": None}]}

        def usage(n: int) -> dict:
            return {"prompt_tokens": prompt_len, "completion_tokens": n,
                    "total_tokens": prompt_len + n}

        async def events():
            count = 0
            try:
                if chat:
                    yield f"data: {json.dumps(chunk(None, None, first=True))}\n\n"
                async for event in request:
                    count += event.token_id is not None
                    if event.finish_reason == "error":
                        body = APIError(500, event.error or "generation failed",
                                        kind="server_error").body()
                        yield f"data: {json.dumps(body)}\n\n"
                        return
                    finish = event.finish_reason if event.finish_reason in ("stop", "length") \
                        else None
                    if event.text or finish:
                        yield f"data: {json.dumps(chunk(event.text, finish))}\n\n"
                    if event.finish_reason == "cancelled":    # the server is shutting down
                        body = APIError(503, "the request was cancelled: the server is "
                                             "shutting down", kind="service_unavailable").body()
                        yield f"data: {json.dumps(body)}\n\n"
                        return
                if include_usage:
                    yield f"data: {json.dumps({**chunk(None, None), 'choices': [], 'usage': usage(count)})}\n\n"  # noqa: E501
                yield "data: [DONE]\n\n"
            finally:
                request.cancel()      # the client went away, or we are done: free the engine

        async def whole():
            pieces, count, finish = [], 0, None
            try:
                async for event in request:
                    count += event.token_id is not None
                    pieces.append(event.text)
                    finish = event.finish_reason
                    if finish == "error":
                        raise APIError(500, event.error or "generation failed",
                                       kind="server_error")
                    if finish == "cancelled":
                        raise APIError(503, "the request was cancelled: the server is "
                                            "shutting down", kind="service_unavailable")
            finally:
                request.cancel()
            text = "".join(pieces)
            choice = ({"index": 0, "message": {"role": "assistant", "content": text},
                       "finish_reason": finish} if chat else
                      {"index": 0, "text": text, "finish_reason": finish, "logprobs": None})
            return {"id": ident, "object": kind, "created": stamp, "model": model_id,
                    "choices": [choice], "usage": usage(count)}

        return events, whole

    async def respond(request, prompt_len: int, chat: bool, body) -> Any:
        include_usage = bool((body.stream_options or {}).get("include_usage"))
        events, whole = run(request, prompt_len, chat, include_usage)
        if body.stream:
            return StreamingResponse(events(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await whole()

    @app.post("/v1/completions")
    async def completions(body: CompletionBody):  # type: ignore[valid-type]
        _check_common(body, fields_completion, model_id)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError(400, f"prompt: one prompt per request, got {len(prompt)}",
                               param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = tokenizer.encode(prompt)
        else:
            bad = [i for i in prompt if not 0 <= i < vocab]
            if bad:
                raise APIError(400, f"prompt: token ids must be in [0, {vocab}), got {bad[:5]}",
                               param="prompt")
            ids = list(prompt)
        max_tokens = _fit_context(len(ids), body.max_tokens, context)
        params = sampling_params(body, max_tokens)
        request = await submit(ids, params, [] if body.ignore_eos else eos)
        return await respond(request, len(ids), False, body)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody):  # type: ignore[valid-type]
        _check_common(body, fields_chat, model_id)
        try:
            ids = tokenizer.encode_chat([{"role": m.role, "content": m.content}
                                         for m in body.messages])
        except (TypeError, ValueError) as err:
            raise APIError(400, f"messages: {err}", param="messages") from None
        max_tokens = body.max_completion_tokens or body.max_tokens
        max_tokens = _fit_context(len(ids), max_tokens, context)
        params = sampling_params(body, max_tokens)
        request = await submit(ids, params, [] if body.ignore_eos else end_of_turn)
        return await respond(request, len(ids), True, body)

    return app


# ----------------------------------------------------------------------------------------------
# command line


def default_kv_blocks(cfg, max_running: int, model_id: str, block_size: int = 16,
                      budget_bytes: int = KV_POOL_BYTES) -> int:
    """The KV pool when --kv-blocks is not given: room for max_running sequences of
    min(context, 512) positions (the engine's default), capped at budget_bytes of float32 K
    and V; prints a note when capped (SmolLM2's 8192-position context would otherwise ask for
    755 MB)."""
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tinygpt serve",
        description="Serve a TinyGPT checkpoint over an OpenAI-compatible HTTP API.")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    parser.add_argument("--model", default=None,
                        help="tinygpt (the shipped checkpoint, default), smollm2 (the installed "
                             "SmolLM2-135M-Instruct), a .gguf file, a TinyGPT checkpoint "
                             "folder or a Hugging Face Llama folder")
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
    parser.add_argument("--kv-blocks", type=int, default=None,
                        help="KV-cache blocks of 16 positions (default: room for --max-running "
                             "sequences of 512 positions)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """`python -m tinygpt serve [--host H] [--port N] [--model PATH] ...`"""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    import torch
    import uvicorn

    from tinygpt.engine import AsyncEngine, SerialEngine
    from tinygpt.loading import load_model

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
                        ("--token-budget", args.token_budget), ("--kv-blocks", args.kv_blocks)):
        if value is not None and value < 1:
            problems.append(f"{flag} must be >= 1, got {value}")
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
    if args.kv_blocks is None and args.engine == "batch":
        args.kv_blocks = default_kv_blocks(model.cfg, args.max_running, info.model_id)
    if args.engine == "serial":
        engine = SerialEngine(model.eval(), tokenizer, max_waiting=args.max_queue)
    else:
        engine = AsyncEngine(model.eval(), tokenizer, max_waiting=args.max_queue,
                             max_running=args.max_running, token_budget=args.token_budget,
                             num_blocks=args.kv_blocks)
    app = create_app(engine, tokenizer, model.cfg.max_seq_len, grace_s=args.grace,
                     model_id=info.model_id, eos_ids=info.eos_ids,
                     end_of_turn_ids=info.end_of_turn_ids)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="info",
                            timeout_graceful_shutdown=round(args.grace) + 5)

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
