"""create_app: the FastAPI application over an engine, wired from the rooms of this package.
It builds the model's text side (prompts.Prompts), the metrics (metrics.Metrics) and the thread
pool that parses and tokenizes, hands them to the routes (routes.py) through app.state, turns
every error into OpenAI's error body, counts every response, publishes /openapi.json and /docs
(openapi.py), and on shutdown gives running requests `grace_s` seconds to finish."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from tinygpt.server.metrics import Metrics
from tinygpt.server.openapi import add_docs, openapi_schema
from tinygpt.server.prompts import Prompts
from tinygpt.server.protocol import BODY_TIMEOUT_S, MAX_BODY_BYTES, MODEL_ID, APIError
from tinygpt.server.routes import Served, router
from tinygpt.structured import Grammars


def parse_workers() -> int:
    """Threads that parse, tokenize, check schemas and compile grammars: half the usable cores,
    at least one. The engine's decode step spreads its products over every core, and each of
    these threads that computes takes a core from it: with two of them on a 2-core machine,
    hostile structured requests stretched ordinary streams' token gaps to 100-105 ms; with
    one, 66-72 ms (the bench row structured_hostile_stall, AMD EPYC with AVX-512,
    2026-11-27)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 2) // 2)


class CountResponses:
    """ASGI middleware: counts every HTTP response by path and status as its start goes out
    (but a crash's 500, which Starlette sends from outside the middleware: create_app's handler
    counts that one).
    Plain ASGI on purpose: Starlette's BaseHTTPMiddleware (`@app.middleware("http")`) passes
    each chunk of a streamed response through a memory stream and a task of its own, CPU the
    engine's decode step loses on a small machine, once per token."""

    def __init__(self, app, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]

        async def counted(message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.count(path, message["status"])
            await send(message)

        await self.app(scope, receive, counted)


def create_app(engine, tokenizer, context: int, *, grace_s: float = 5.0,
               max_body_bytes: int = MAX_BODY_BYTES, body_timeout_s: float = BODY_TIMEOUT_S,
               workers: int | None = None, model_id: str = MODEL_ID, eos_ids=None,
               end_of_turn_ids=None):
    """The FastAPI app over `engine` (AsyncEngine's interface) and `tokenizer` (encode,
    decode, encode_chat, special_tokens); `context`: the model's max_seq_len. Requests bigger
    than max_body_bytes get a 413; bodies slower than body_timeout_s a 408; `workers` threads
    parse and tokenize (default parse_workers(): half the cores). model_id: the name served.
    eos_ids end a completion, end_of_turn_ids a chat reply (default: the tokenizer's
    "<|endoftext|>", and "<|end|>" then it; see tinygpt.loading.ModelInfo)."""
    metrics = Metrics(engine)
    engine.on_finish = metrics.observe
    vocab = getattr(getattr(engine.model, "cfg", None), "vocab_size", 1 << 31)
    # structured outputs need constraints in the engine's sampler and a tokenizer the grammar
    # engine can read; without them, grammars says why (a request asking for one gets a 400)
    grammars: Grammars | str = "the engine takes no constraints (--tensor-parallel-size > 1)"
    if getattr(getattr(engine, "engine", engine), "takes_constraints", True):
        try:
            grammars = Grammars(tokenizer, vocab)
        except (ValueError, TypeError, AttributeError) as err:
            grammars = f"the grammar engine cannot read this model's tokenizer ({err})"
    # the paged engine's KV pool bounds a request's positions (chat's default max_tokens stops
    # where it ends); the serial engine and the tensor-parallel one have no pool here
    cache = getattr(getattr(engine, "engine", None), "cache", None)
    max_positions = (None if getattr(cache, "allocator", None) is None
                     else cache.allocator.num_blocks * cache.block_size)
    prompts = Prompts(tokenizer, context, vocab, model_id, eos_ids, end_of_turn_ids, grammars,
                      max_positions)
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int)
                                or workers < 1):
        raise ValueError(f"workers must be None (half the cores) or an integer >= 1, "
                         f"got {workers!r}")
    pool = ThreadPoolExecutor(workers or parse_workers(), thread_name_prefix="tinygpt-parse")

    @asynccontextmanager
    async def lifespan(app):
        yield
        await engine.shutdown(grace_s)
        pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="tinygpt", version="1", lifespan=lifespan, docs_url=None,
                  redoc_url=None, openapi_url="/openapi.json",
                  description=f"An OpenAI-compatible server for {model_id} (context {context} "
                              f"tokens). Errors are OpenAI's {{\"error\": {{...}}}} bodies.")
    app.state.served = Served(engine, prompts, metrics, pool, max_body_bytes, body_timeout_s)
    app.include_router(router)
    app.openapi = lambda: openapi_schema(app)
    add_docs(app)

    app.add_middleware(CountResponses, metrics=metrics)

    def error_response(err: APIError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(APIError)
    async def api_error(_, err: APIError):
        return error_response(err)

    @app.exception_handler(RequestValidationError)
    async def invalid(_, err: RequestValidationError):
        errors = err.errors()
        first = errors[0] if errors else {}
        where = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return error_response(APIError(422, f"{where}: {first.get('msg')}", param=where))

    @app.exception_handler(HTTPException)
    async def http_error(_, err: HTTPException):
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        return error_response(APIError(err.status_code, str(err.detail), kind=kind,
                                       headers=err.headers))     # a 405's Allow, say

    @app.exception_handler(Exception)
    async def crashed(request, err: Exception):     # a bug: still a JSON body, logged, counted
        import traceback
        traceback.print_exception(err)
        # Starlette answers this one outside the middleware, so CountResponses never sees it
        metrics.count(request.scope["path"], 500)
        return error_response(APIError(500, f"internal error: {type(err).__name__}",
                                       kind="server_error"))

    return app
