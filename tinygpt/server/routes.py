"""The endpoints, each a few lines that hand the work on: request bodies are read here under
the HTTP limits, JSON only (limits.read_body), then parsed, checked and tokenized on the thread
pool (prompts.Prompts), submitted to the engine, and answered whole or streamed
(responses.whole / responses.events). What a route needs it reads from `app.state.served`,
which create_app (app.py) sets: the routes hold no state of their own."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from tinygpt.engine import EngineClosed, EngineFull
from tinygpt.server.checks import check_model
from tinygpt.server.limits import read_body
from tinygpt.server.metrics import Metrics
from tinygpt.server.openapi import ERRORS, request_body, stream_or
from tinygpt.server.prompts import Job, Prompts
from tinygpt.server.protocol import (
    RETRY_AFTER_S,
    APIError,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from tinygpt.server.responses import events, whole


@dataclass
class Served:
    """What the routes serve: the engine (AsyncEngine's interface), the model's text side,
    the metrics, the thread pool that parses and tokenizes, and the body limits."""

    engine: object
    prompts: Prompts
    metrics: Metrics
    pool: ThreadPoolExecutor
    max_body_bytes: int
    body_timeout_s: float

    async def off_loop(self, fn: Callable, *args):
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def body(self, request: Request) -> bytes:
        return await read_body(request, self.max_body_bytes, self.body_timeout_s)

    def model_card(self) -> dict:
        """The model as /v1/models lists it; max_model_len is what a request's prompt and
        max_tokens may take: the context, or the KV pool's positions for one request when
        those are fewer (prompts.Prompts.max_model_len)."""
        return {"id": self.prompts.model_id, "object": "model", "created": 0,
                "owned_by": "tinygpt", "max_model_len": self.prompts.max_model_len}


def served(request: Request) -> Served:
    return request.app.state.served


router = APIRouter()

# the endpoints that read a JSON body (limits.read_body) also answer 415
BODY_ERRORS = {**ERRORS, 415: {"model": ErrorResponse, "description": "a Content-Type other "
                               "than application/json, or a Content-Encoding other than "
                               "identity"}}

# -- health, metrics, models ----------------------------------------------------------------------


@router.get("/health")
async def health(request: Request):
    engine = served(request).engine
    if not getattr(engine, "alive", True):      # its worker stopped: nothing will be served
        return JSONResponse({"status": "stopped", **vars(engine.stats())}, status_code=503)
    return {"status": "ok", **vars(engine.stats())}


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(request: Request):
    text, media_type = served(request).metrics.text()
    return PlainTextResponse(text, media_type=media_type)


@router.get("/v1/models", responses={200: {"model": ModelList}})
async def models(request: Request):
    return {"object": "list", "data": [served(request).model_card()]}


@router.get("/v1/models/{name:path}", responses={200: {"model": ModelCard}, **ERRORS})
async def one_model(request: Request, name: str):
    model_id = served(request).prompts.model_id
    check_model(name, model_id)          # OpenAI's answer, as the generation endpoints give it
    return served(request).model_card()


# -- tokenizer endpoints (vLLM's shapes) ----------------------------------------------------------


@router.post("/tokenize", openapi_extra=request_body(TokenizeRequest),
             responses={200: {"model": TokenizeResponse}, **BODY_ERRORS})
async def tokenize(request: Request):
    state = served(request)
    return await state.off_loop(state.prompts.tokenize, await state.body(request))


@router.post("/detokenize", openapi_extra=request_body(DetokenizeRequest),
             responses={200: {"model": DetokenizeResponse}, **BODY_ERRORS})
async def detokenize(request: Request):
    state = served(request)
    return await state.off_loop(state.prompts.detokenize, await state.body(request))


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request):
    return served(request).prompts.info()


# -- generation -----------------------------------------------------------------------------------


async def submit_all(engine, job: Job) -> list:
    """One engine request per choice, each with its own constraint when the reply has a
    grammar; none at all when the engine refuses one (429 when its queue is full, 503 while
    it shuts down, 400 for what it cannot take)."""
    requests = []
    try:
        for p, params in zip(job.prompt_of, job.params, strict=True):
            constraint = None if job.grammar is None else job.grammar.constraint(job.eos)
            requests.append(await engine.submit(
                job.prompts[p], params, job.eos, logprobs=job.logprobs,
                prompt_logprobs=job.logprobs if job.echo and job.logprobs is not None
                else None, constraint=constraint, scoring=job.score_only))
    except BaseException as err:
        for request in requests:
            request.cancel()
        if isinstance(err, EngineFull):
            raise APIError(429, str(err), kind="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        if isinstance(err, EngineClosed):
            raise APIError(503, str(err), kind="service_unavailable") from None
        if isinstance(err, TypeError | ValueError):   # what the engine itself cannot take
            raise APIError(400, str(err)) from None
        raise
    return requests


async def generate(request: Request, chat: bool):
    state = served(request)
    job = await state.off_loop(state.prompts.prepare, await state.body(request), chat)
    requests = await submit_all(state.engine, job)
    stamp, ident = int(time.time()), f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    if job.stream:
        return StreamingResponse(events(job, requests, ident, stamp, state.prompts),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    return await unless_gone(request, whole(job, requests, ident, stamp, state.prompts))


async def unless_gone(request: Request, work) -> Response:
    """Await a whole response's `work`; a client that hangs up first cancels it (whole's
    `finally` cancels the engine's requests, so their slots and KV blocks are freed at once,
    as a stream's are) and gets 499, which nobody reads but /metrics counts."""
    task = asyncio.ensure_future(work)

    async def hang_up() -> None:          # the body is read: the next message is the hang-up
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(hang_up())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    try:
        return await task
    except asyncio.CancelledError:
        if not watcher.done() or watcher.cancelled():
            raise                          # we are cancelled ourselves, not the client gone
        return Response(status_code=499)


@router.post("/v1/completions", openapi_extra=request_body(CompletionRequest),
             responses={200: stream_or(CompletionResponse), **BODY_ERRORS})
async def completions(request: Request):
    return await generate(request, chat=False)


@router.post("/v1/chat/completions", openapi_extra=request_body(ChatCompletionRequest),
             responses={200: stream_or(ChatCompletionResponse), **BODY_ERRORS})
async def chat_completions(request: Request):
    return await generate(request, chat=True)
