"""`python -m tinygpt serve`: an OpenAI-compatible HTTP server over a tinygpt engine.

    python -m tinygpt serve --port 8000          # the shipped checkpoint on 127.0.0.1:8000

    POST /v1/completions       prompt (text, token ids, or a list of either) -> text; stream:
                               true sends server-sent events, then "data: [DONE]"; as Hugging
                               Face's tokenizer and vLLM do, a text prompt's special-token
                               names ("<|im_start|>") are read as their ids (chat messages'
                               content stays text)
    POST /v1/chat/completions  messages -> the assistant's reply, through the chat template
    GET  /v1/models            the one model, under its own id ("tinygpt",
                               "SmolLM2-135M-Instruct"); /v1/models/{id} alone
    POST /tokenize             vLLM's: {"prompt"} or {"messages"} -> {"count", "max_model_len",
                               "tokens", "token_strs"}; as vLLM's, it reads the names of
                               special tokens ("<|endoftext|>") as their ids, and
                               add_special_tokens (default true for a prompt, false for
                               messages) puts the BOS first where the tokenizer adds one
    POST /detokenize           vLLM's: {"tokens"} -> {"prompt"}
    GET  /tokenizer_info       the tokenizer's special tokens (eos, bos, pad), vocabulary size,
                               context and chat template (a Jinja2 string, when it has one)
    GET  /health               {"status": "ok", ...engine counts}
    GET  /metrics              Prometheus text: requests, tokens, running / waiting, TTFT, ITL,
                               the KV pool and the prefix cache

Requests. Both endpoints take the OpenAI fields model, max_tokens (chat: also
max_completion_tokens), temperature, top_p, seed, stop, presence_penalty, frequency_penalty,
n, stream, stream_options.include_usage, and vLLM's top_k, min_p and ignore_eos.
/v1/completions also takes echo (the prompt is returned before the completion) and logprobs
(an int k: each token's log-probability and its k most likely alternatives; with echo, the
prompt's tokens too; max_tokens 0 with echo scores the prompt alone, generating nothing);
/v1/chat/completions takes logprobs (true / false) and top_logprobs.
Log-probabilities are the log-softmax of the model's raw logits, before temperature,
penalties and filters (vLLM's default), so they do not depend on the sampling knobs. A list
of prompts gives a choice per prompt; n > 1 gives n choices per prompt, choice i of a seeded
request sampling with seed + i. Message content is a string or a list of {"type": "text"}
parts (joined with newlines); the "developer" role is the system role; a "tool" message goes
to the chat template, which answers a 400 when it has no such role (the shipped one has not).
Fields that change nothing here are accepted (user, store, metadata, logprobs: false,
response_format {"type": "text"}, parallel_tool_calls); fields that would change the output
and are not implemented (tools, logit_bias, suffix, other response formats, ...) are a 400.

Limits. A body over --max-body-bytes is a 413; a body that does not arrive within
--body-timeout seconds a 408; a prompt too long for the context is refused from its length in
characters before it is tokenized whenever no tokenization could make it fit; stop strings
may total MAX_STOP_CHARS characters. JSON parsing, validation, tokenization and the chat
template run on a thread pool, not on the event loop, so a large request never stalls the
streams of the others (parsing still holds Python's GIL while it runs, which the body limit
bounds: a megabyte of token ids parses in well under 100 ms; lists longer than any valid
request are refused before they are validated item by item). uvicorn closes idle keep-alive
connections after 5 s and connections whose request headers have not arrived after
--header-timeout seconds.

Errors. Every error is an OpenAI-style JSON body {"error": {"message", "type", "param",
"code"}}: 400 for malformed JSON (lone surrogates, NaN and 5000-digit numbers included),
values out of range, unsupported fields and prompts or max_tokens that do not fit the
context; 422 for a field of the wrong type; 404 for an unknown model or path; 413, 408; 429
(with Retry-After) when the engine's queue is full; 503 while shutting down. Streaming
requests are checked whole before the 200 and the first event. A bad request never disturbs
the others. A streaming client that disconnects has its request cancelled at once. On
SIGTERM uvicorn stops accepting connections, running requests get `--grace` seconds to
finish, and the rest are cancelled.

The engine (tinygpt/engine.py) is AsyncEngine by default: continuous batching on a paged KV
cache (--max-running, --token-budget, --kv-blocks) with automatic prefix caching: full KV
blocks of earlier requests stay in the pool, found again by a key chained over their tokens,
so a conversation that resends its history, or requests that share a system prompt, prefill
only what is new (--no-prefix-caching turns it off; /metrics gives the cached blocks and the
hit rate). `--engine serial` serves one request at a time (the reference; no logprobs).
"""

import argparse
import asyncio
import inspect
import json
import re
import signal
import sys
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

MODEL_ID = "tinygpt"
KV_POOL_BYTES = 256 * 2**20          # the default KV pool's ceiling (see default_kv_blocks)
MAX_BODY_BYTES = 1024 * 1024         # --max-body-bytes default
BODY_TIMEOUT_S = 30.0                # --body-timeout default
HEADER_TIMEOUT_S = 10.0              # --header-timeout default
KEEP_ALIVE_S = 5                     # idle keep-alive connections are closed after this
MAX_STOP_CHARS = 1024                # all stop strings together, in characters
MAX_N = 16                           # choices per prompt
MAX_CHOICES = 64                     # choices per request (prompts times n)
MAX_LOGPROBS = 20                    # top alternatives per token
MAX_SEED = 2**63 - 1
RETRY_AFTER_S = 1                    # the 429's Retry-After
CHAT_ROLES = {"developer": "system"}   # OpenAI roles renamed for the chat template


class APIError(Exception):
    """An error answered as OpenAI does: status code and an {"error": {...}} body."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = (status, message, param,
                                                                      kind, code)
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


# ----------------------------------------------------------------------------------------------
# request bodies


def _models():
    """The request bodies (pydantic), built on first use so importing tinygpt stays light."""
    from pydantic import BaseModel, ConfigDict

    config = ConfigDict(extra="allow", allow_inf_nan=False)

    class Common(BaseModel):
        model_config = config
        model: str | None = None
        max_tokens: int | None = None
        temperature: float | None = None
        top_p: float | None = None
        top_k: int | None = None
        min_p: float | None = None
        stop: str | list[str] | None = None
        stream: bool | None = False
        stream_options: dict | None = None
        seed: int | None = None
        presence_penalty: float | None = None
        frequency_penalty: float | None = None
        n: int | None = None
        best_of: int | None = None
        user: str | None = None
        store: bool | None = None
        metadata: dict | None = None
        response_format: dict | None = None
        logit_bias: dict | None = None
        ignore_eos: bool | None = False

    class CompletionBody(Common):
        prompt: str | list[str] | list[int] | list[list[int]]
        echo: bool | None = False
        logprobs: bool | int | None = None       # false: none (a no-op some clients send)
        suffix: str | None = None

    class Part(BaseModel):
        model_config = config
        type: str
        text: str | None = None

    class Message(BaseModel):
        model_config = config
        role: str
        content: str | list[Part] | None = None
        name: str | None = None
        tool_call_id: str | None = None
        tool_calls: list | None = None

    class ChatBody(Common):
        messages: list[Message]
        max_completion_tokens: int | None = None
        logprobs: bool | None = None
        top_logprobs: int | None = None
        tools: list | None = None
        tool_choice: str | dict | None = None
        parallel_tool_calls: bool | None = None

    class TokenizeBody(BaseModel):
        model_config = config
        model: str | None = None
        prompt: str | None = None
        messages: list[Message] | None = None
        add_special_tokens: bool | None = None
        add_generation_prompt: bool | None = True
        return_token_strs: bool | None = False

    class DetokenizeBody(BaseModel):
        model_config = config
        model: str | None = None
        tokens: list[int]

    return CompletionBody, ChatBody, TokenizeBody, DetokenizeBody


SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _no_constant(name: str):
    raise APIError(400, f"the body is not valid JSON: {name} is not a JSON number")


def parse_json(raw: bytes | str) -> Any:
    """The body as JSON; APIError 400 for anything JSON (RFC 8259) does not allow, numbers of
    more than 4300 digits, and strings with lone surrogates (not Unicode text)."""
    if isinstance(raw, str):
        raw = raw.encode("utf-8", "surrogatepass")
    try:
        value = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, RecursionError) as err:      # JSONDecodeError, UnicodeDecodeError, ...
        raise APIError(400, f"the body is not valid JSON: {err}") from None
    # a lone surrogate can only come from a \uD800-\uDFFF escape (raw bytes that are not
    # UTF-8 fail above): walk the parsed body only when the text holds such an escape
    where = _lone_surrogate(value, "") if SURROGATE_ESCAPE.search(raw) else None
    if where is not None:
        raise APIError(400, f"{where or 'the body'}: a string holds a lone surrogate "
                            f"(a half of a UTF-16 pair), which is not Unicode text",
                       param=where or None)
    return value


def _lone_surrogate(value: Any, path: str) -> str | None:
    """The path of the first string (or key) that cannot be UTF-8 encoded, else None."""
    stack = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return where
        elif isinstance(item, dict):
            for key, sub in item.items():
                name = f"{where}.{key}" if where else str(key)
                try:
                    key.encode("utf-8")
                except UnicodeEncodeError:
                    return where
                stack.append((sub, name))
        elif isinstance(item, list):         # (numbers need no check, nor a path)
            stack.extend((sub, f"{where}[{i}]") for i, sub in enumerate(item)
                         if isinstance(sub, str | dict | list))
    return None


def validate(model, data: Any):
    """A pydantic model from parsed JSON; APIError 422 naming the first bad field."""
    from pydantic import ValidationError

    if not isinstance(data, dict):
        raise APIError(422, f"the body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or None
        message = str(first.get("msg"))
        raise APIError(422, f"{where}: {message}" if where else message, param=where) from None
    except (ValueError, TypeError, OverflowError, RecursionError) as err:
        raise APIError(422, f"the body does not fit the schema: {err}") from None


# ----------------------------------------------------------------------------------------------
# checks shared by the endpoints


def _bounded(name: str, value, low, high):
    if value is not None and not low <= value <= high:
        raise APIError(400, f"{name} must be in [{low}, {high}], got {value}", param=name)
    return value


def sampling_params(body, max_tokens: int, seed: int | None):
    """SamplingParams from a request body; APIError 400 naming the field when out of range."""
    from tinygpt.sampling import SamplingParams

    stop = body.stop
    stop = () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop)
    total = sum(len(s) for s in stop)
    if total > MAX_STOP_CHARS:
        raise APIError(400, f"stop: the stop strings hold {total} characters together; at most "
                            f"{MAX_STOP_CHARS}", param="stop")
    top_p = 1.0 if body.top_p is None else body.top_p
    if not 0 < top_p <= 1:
        raise APIError(400, f"top_p must be in (0, 1], got {top_p}", param="top_p")
    for name in ("presence_penalty", "frequency_penalty"):
        _bounded(name, getattr(body, name), -2, 2)
    top_k = body.top_k
    if top_k == -1:              # vLLM's "off"
        top_k = 0
    _bounded("top_k", top_k, 0, 1 << 31)
    _bounded("temperature", body.temperature, 0, 1e6)
    try:
        return SamplingParams(
            temperature=1.0 if body.temperature is None else body.temperature, top_p=top_p,
            top_k=top_k or 0, min_p=body.min_p or 0.0,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0, max_new_tokens=max_tokens,
            stop=stop, seed=seed)
    except (TypeError, ValueError) as err:
        words = re.findall(r"[a-z_]+", str(err))
        param = words[0] if words else None
        param = "max_tokens" if param == "max_new_tokens" else param
        raise APIError(400, str(err).replace("max_new_tokens", "max_tokens"),
                       param=param) from None


def _check_common(body, chat: bool, model_id: str = MODEL_ID) -> None:
    unknown = sorted(set(body.model_extra or {}))
    if unknown:
        fields = sorted(type(body).model_fields)
        raise APIError(400, f"unsupported field(s) {unknown}; this server supports {fields}",
                       param=unknown[0])
    if body.model is not None and body.model != model_id:
        raise APIError(404, f"the model {body.model!r} does not exist; this server serves "
                            f"{model_id!r}", param="model", code="model_not_found")
    _bounded("n", body.n, 1, MAX_N)
    if body.best_of is not None and body.best_of != (body.n or 1):
        raise APIError(400, f"best_of must equal n (ranking candidates is not implemented), got "
                            f"best_of={body.best_of} n={body.n or 1}", param="best_of")
    _bounded("seed", body.seed, 0, MAX_SEED)
    if body.logit_bias:
        raise APIError(400, "logit_bias is not implemented", param="logit_bias")
    if body.response_format is not None and body.response_format.get("type") != "text":
        raise APIError(400, f"response_format: only {{'type': 'text'}} is implemented, got "
                            f"{body.response_format!r}"[:300], param="response_format")
    if body.stream_options is not None:
        if not body.stream:
            raise APIError(400, "stream_options needs stream: true", param="stream_options")
        options = body.stream_options
        extra = set(options) - {"include_usage", "continuous_usage_stats"}
        if extra or not all(isinstance(options.get(name, False), bool) for name in options):
            raise APIError(400, "stream_options takes include_usage and vLLM's "
                                "continuous_usage_stats (true / false)", param="stream_options")
    if chat:
        if body.tools:
            raise APIError(400, "tools (function calling) is not implemented", param="tools")
        if body.tool_choice not in (None, "none", "auto"):
            raise APIError(400, "tool_choice: only 'none' is possible without tools",
                           param="tool_choice")
        if body.logprobs:
            _bounded("top_logprobs", body.top_logprobs, 0, MAX_LOGPROBS)
        elif body.top_logprobs is not None:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    else:
        if body.logprobs is False:
            body.logprobs = None
        if body.logprobs is True:
            raise APIError(400, f"logprobs: give how many alternatives per token (an int in "
                                f"[0, {MAX_LOGPROBS}]), got true", param="logprobs")
        _bounded("logprobs", body.logprobs, 0, MAX_LOGPROBS)
        if body.suffix:
            raise APIError(400, "suffix (insertion) is not implemented", param="suffix")


def _fit_context(prompt_len: int, max_tokens: int | None, context: int,
                 param: str = "max_tokens") -> int:
    if prompt_len == 0:
        raise APIError(400, "the prompt is empty: give at least one token", param="prompt")
    if prompt_len >= context:
        raise APIError(400, f"the prompt has {prompt_len} tokens; the model's context is "
                            f"{context}, so a prompt may have at most {context - 1}",
                       param="prompt", code="context_length_exceeded")
    if max_tokens is None:
        return min(16, context - prompt_len)
    if max_tokens < 1:
        raise APIError(400, f"{param} must be >= 1, got {max_tokens}", param=param)
    if prompt_len + max_tokens > context:
        raise APIError(400, f"{param} too large: the prompt's {prompt_len} tokens plus "
                            f"{param} {max_tokens} exceed the model's context of {context} "
                            f"(at most {context - prompt_len})", param=param,
                       code="context_length_exceeded")
    return max_tokens


def max_token_chars(tokenizer, vocab_size: int) -> int:
    """The most characters one token's text can hold (special tokens' names included): a
    text of more than (context - 1) times this many characters can never fit the context."""
    longest = 1
    for i in range(vocab_size):
        try:
            longest = max(longest, len(tokenizer.decode([i])))
        except Exception:  # noqa: BLE001 (an id without text of its own)
            continue
    return longest


@dataclass
class Job:
    """A checked request, ready for the engine: one entry per choice."""

    chat: bool
    prompts: list[list[int]]          # per prompt
    texts: list[str | None]           # per prompt: its text (completions' echo), if it had one
    params: list                      # per choice (prompt-major): SamplingParams
    prompt_of: list[int]              # per choice: its prompt's index
    eos: list[int]
    logprobs: int | None              # top alternatives per generated token (None: none)
    echo: bool
    stream: bool
    include_usage: bool
    continuous_usage: bool            # usage so far in every chunk (vLLM's extension)
    score_only: bool = False          # max_tokens 0 with echo: the prompt and its logprobs only


# ----------------------------------------------------------------------------------------------
# the application


def create_app(engine, tokenizer, context: int, *, grace_s: float = 5.0,
               max_body_bytes: int = MAX_BODY_BYTES, body_timeout_s: float = BODY_TIMEOUT_S,
               workers: int = 2, model_id: str = MODEL_ID, eos_ids=None, end_of_turn_ids=None):
    """The FastAPI app over `engine` (AsyncEngine's interface) and `tokenizer` (encode,
    decode, encode_chat, special_tokens); `context`: the model's max_seq_len. Requests bigger
    than max_body_bytes get a 413; bodies slower than body_timeout_s a 408; `workers` threads
    parse and tokenize. model_id: the name served. eos_ids end a completion, end_of_turn_ids
    a chat reply (default: the tokenizer's "<|endoftext|>", and "<|end|>" then it; see
    tinygpt.loading.ModelInfo)."""
    import prometheus_client as prom
    from fastapi import FastAPI
    from fastapi import Request as HTTPRequest
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.exceptions import HTTPException

    from tinygpt.engine import EngineClosed, EngineFull, latency_samples

    CompletionBody, ChatBody, TokenizeBody, DetokenizeBody = _models()
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
    gauges = {
        "tinygpt_requests_running": ("requests generating now", "running"),
        "tinygpt_requests_waiting": ("requests waiting for the engine", "waiting"),
        "tinygpt_kv_blocks_used": ("KV-cache blocks in use", "kv_blocks_used"),
        "tinygpt_kv_blocks_total": ("KV-cache blocks in the pool", "kv_blocks_total"),
        "tinygpt_preemptions": ("sequences preempted so far", "preemptions"),
        "tinygpt_prefix_cache_blocks": ("KV blocks findable by a prefix key (in use or kept "
                                         "after their request ended)", "prefix_cached_blocks"),
        "tinygpt_prefix_cache_queries": ("prompt tokens looked up in the prefix cache",
                                         "prefix_query_tokens"),
        "tinygpt_prefix_cache_hits": ("prompt tokens found in the prefix cache (not computed)",
                                      "prefix_hit_tokens"),
    }
    for name, (doc, attr) in gauges.items():
        prom.Gauge(name, doc, registry=registry).set_function(
            lambda attr=attr: getattr(engine.stats(), attr))

    def hit_rate() -> float:
        stats = engine.stats()
        return stats.prefix_hit_tokens / stats.prefix_query_tokens if \
            stats.prefix_query_tokens else 0.0

    prom.Gauge("tinygpt_prefix_cache_hit_rate", "prefix-cache hits over queries (tokens)",
               registry=registry).set_function(hit_rate)
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
    eos = ([specials[t] for t in ("<|endoftext|>",) if t in specials] if eos_ids is None
           else list(eos_ids))
    end_of_turn = ([specials[t] for t in ("<|end|>",) if t in specials] + eos
                   if end_of_turn_ids is None else list(end_of_turn_ids))
    vocab = getattr(getattr(engine.model, "cfg", None), "vocab_size", 1 << 31)
    bos_id = getattr(tokenizer, "bos_id", None)
    # a BOS the tokenizer puts before a text (GGUF's tokenizer.ggml.add_bos_token); the chat
    # template writes its own markers, and token-id prompts are taken as they are
    bos_prefix = [bos_id] if bos_id is not None and getattr(tokenizer, "add_bos", False) else []
    chars_per_token = max_token_chars(tokenizer, vocab)
    pool = ThreadPoolExecutor(workers, thread_name_prefix="tinygpt-parse")
    paths = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics",
             "/tokenize", "/detokenize", "/tokenizer_info")

    @asynccontextmanager
    async def lifespan(app):
        yield
        await engine.shutdown(grace_s)
        pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="tinygpt", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)

    @app.middleware("http")
    async def count(request: HTTPRequest, call_next):
        response = await call_next(request)
        path = request.url.path
        known = path if path in paths else "/v1/models" if path.startswith(
            "/v1/models/") else "other"
        http_requests.labels(known, str(response.status_code)).inc()
        return response

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
        return error_response(APIError(err.status_code, str(err.detail), kind=kind))

    @app.exception_handler(Exception)
    async def crashed(_, err: Exception):       # a bug: still a JSON body, and logged
        import traceback
        traceback.print_exception(err)
        return error_response(APIError(500, f"internal error: {type(err).__name__}",
                                       kind="server_error"))

    async def off_loop(fn: Callable, *args):
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    async def read_body(request: HTTPRequest) -> bytes:
        """The body, refused with 413 past max_body_bytes (by Content-Length before reading
        when the client sends one) and 408 when it does not arrive in body_timeout_s."""
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > max_body_bytes):
            raise APIError(413, f"the body has {length} bytes; this server takes at most "
                                f"{max_body_bytes} (--max-body-bytes)", code="body_too_large")
        chunks, size = [], 0

        async def receive() -> None:
            nonlocal size
            async for chunk in request.stream():
                size += len(chunk)
                if size > max_body_bytes:
                    raise APIError(413, f"the body is longer than {max_body_bytes} bytes "
                                        f"(--max-body-bytes)", code="body_too_large")
                chunks.append(chunk)

        try:
            await asyncio.wait_for(receive(), body_timeout_s)
        except TimeoutError:
            raise APIError(408, f"the body did not arrive within {body_timeout_s} s",
                           code="request_timeout") from None
        return b"".join(chunks)

    # -- health, metrics, models ----------------------------------------------------------------

    @app.get("/health")
    async def health():
        return {"status": "ok", **vars(engine.stats())}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(prom.generate_latest(registry).decode(),
                                 media_type=prom.CONTENT_TYPE_LATEST)

    model_card = {"id": model_id, "object": "model", "created": 0, "owned_by": "tinygpt",
                  "max_model_len": context}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card]}

    @app.get("/v1/models/{name:path}")
    async def one_model(name: str):
        if name != model_id:
            raise APIError(404, f"the model {name!r} does not exist; this server serves "
                                f"{model_id!r}", param="model", kind="not_found_error",
                           code="model_not_found")
        return model_card

    # -- tokenizer endpoints (vLLM's shapes) -----------------------------------------------------

    def token_text(token_id: int) -> str:
        return tokenizer.decode([token_id])

    def chat_ids(messages) -> tuple[list[int], int]:
        """Token ids of the conversation through the chat template (+ the assistant's turn),
        and its characters; APIError 400 for what the template cannot render."""
        turns, chars = [], 0
        for i, message in enumerate(messages):
            content = message.content
            if isinstance(content, list):
                kinds = sorted({part.type for part in content} - {"text"})
                if kinds:
                    raise APIError(400, f"messages[{i}].content: only text parts are "
                                        f"implemented, got {kinds}", param="messages")
                content = "\n".join(part.text or "" for part in content)
            if message.tool_calls:
                raise APIError(400, f"messages[{i}].tool_calls: tool calls are not "
                                    f"implemented", param="messages")
            turns.append({"role": CHAT_ROLES.get(message.role, message.role),
                          "content": content or ""})
            chars += len(content or "")
        if chars > (context - 1) * chars_per_token:
            raise APIError(400, f"messages hold {chars} characters; no tokenization of them "
                                f"fits the model's context of {context} tokens",
                           param="messages", code="context_length_exceeded")
        try:
            return tokenizer.encode_chat(turns), chars
        except (TypeError, ValueError, KeyError) as err:
            raise APIError(400, f"messages: {err}", param="messages") from None

    def text_ids(text: str, param: str = "prompt", specials: bool = False) -> list[int]:
        if len(text) > (context - 1) * chars_per_token:
            raise APIError(400, f"{param}: {len(text)} characters; no tokenization of them fits "
                                f"the model's context of {context} tokens", param=param,
                           code="context_length_exceeded")
        try:
            if specials and "allowed_special" in inspect.signature(tokenizer.encode).parameters:
                return tokenizer.encode(text, allowed_special="all")
            return tokenizer.encode(text)
        except (TypeError, ValueError) as err:
            raise APIError(400, f"{param}: {err}", param=param) from None

    def check_ids(ids: list[int], param: str) -> list[int]:
        if len(ids) >= context:
            raise APIError(400, f"{param}: {len(ids)} tokens; the model's context is {context}",
                           param=param, code="context_length_exceeded")
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise APIError(400, f"{param}: token ids must be in [0, {vocab}), got {bad[:5]}",
                           param=param)
        return ids

    def tokenizer_body(kind, raw: bytes):
        """The body of a tokenizer endpoint, validated: no unknown fields, this model."""
        body = validate(kind, parse_json(raw))
        if body.model_extra:
            raise APIError(400, f"unsupported field(s) {sorted(body.model_extra)}",
                           param=sorted(body.model_extra)[0])
        if body.model is not None and body.model != model_id:
            raise APIError(404, f"the model {body.model!r} does not exist", param="model",
                           code="model_not_found")
        return body

    def do_tokenize(raw: bytes) -> dict:
        body = tokenizer_body(TokenizeBody, raw)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", param="prompt")
        if body.messages is not None:
            if body.add_generation_prompt is False:
                raise APIError(400, "add_generation_prompt: false is not implemented",
                               param="add_generation_prompt")
            ids, _ = chat_ids(body.messages)
            if body.add_special_tokens:             # vLLM's default for messages: false
                ids = bos_prefix + ids if ids[:1] != bos_prefix else ids
        else:
            ids = text_ids(body.prompt, specials=True)
            if body.add_special_tokens is not False:   # vLLM's default for a prompt: true
                ids = bos_prefix + ids
        return {"count": len(ids), "max_model_len": context, "tokens": ids,
                "token_strs": [token_text(i) for i in ids] if body.return_token_strs else None}

    def do_detokenize(raw: bytes) -> dict:
        body = tokenizer_body(DetokenizeBody, raw)
        bad = [i for i in body.tokens if not 0 <= i < vocab]
        if bad:
            raise APIError(400, f"tokens: ids must be in [0, {vocab}), got {bad[:5]}",
                           param="tokens")
        return {"prompt": tokenizer.decode(body.tokens)}

    @app.post("/tokenize")
    async def tokenize(request: HTTPRequest):
        return await off_loop(do_tokenize, await read_body(request))

    @app.post("/detokenize")
    async def detokenize(request: HTTPRequest):
        return await off_loop(do_detokenize, await read_body(request))

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        # the end-of-text token as its text (what /tokenize reads back as its id): clients
        # such as lm-evaluation-harness find its id by tokenizing it
        pad_id = getattr(tokenizer, "pad_id", None)
        template = getattr(tokenizer, "chat_template", None)
        return {"tokenizer_class": type(tokenizer).__name__, "vocab_size": vocab,
                "model_max_length": context, "max_model_len": context,
                "eos_token": token_text(eos[0]) if eos else None,
                "eos_token_id": eos[0] if eos else None,
                "bos_token": None if bos_id is None else token_text(bos_id),
                "bos_token_id": bos_id, "add_bos_token": bool(bos_prefix),
                "pad_token": None if pad_id is None else token_text(pad_id),
                "special_tokens": dict(specials),
                "chat_template": template if isinstance(template, str) else None}

    # -- generation ------------------------------------------------------------------------------

    def too_long(data: Any) -> None:
        """Refuse lists no valid request has before validating them item by item (a list of
        a million token ids costs pydantic a quarter of a second)."""
        if not isinstance(data, dict):
            return
        prompt, messages = data.get("prompt"), data.get("messages")
        most = max(context - 1, MAX_CHOICES)
        if isinstance(prompt, list) and (len(prompt) > most or any(
                isinstance(p, list) and len(p) >= context for p in prompt)):
            raise APIError(400, f"prompt: a prompt has at most {context - 1} tokens and a "
                                f"request at most {MAX_CHOICES} prompts", param="prompt",
                           code="context_length_exceeded")
        if isinstance(messages, list) and len(messages) >= context:
            raise APIError(400, f"messages: {len(messages)} messages cannot fit the model's "
                                f"context of {context} tokens", param="messages",
                           code="context_length_exceeded")

    def prepare(raw: bytes, chat: bool) -> Job:
        """Everything before the engine, on the thread pool: parse, check, tokenize."""
        data = parse_json(raw)
        too_long(data)
        body = validate(ChatBody if chat else CompletionBody, data)
        _check_common(body, chat, model_id)
        score_only = False
        if chat:
            ids, _ = chat_ids(body.messages)
            prompts, texts = [ids], [None]
            for name in ("max_completion_tokens", "max_tokens"):
                if getattr(body, name) is not None:
                    _bounded(name, getattr(body, name), 1, context)
            name = "max_completion_tokens" if body.max_completion_tokens is not None else \
                "max_tokens"
            asked, param = getattr(body, name), name
            logprobs = (body.top_logprobs or 0) if body.logprobs else None
            echo = False
            stop_ids = end_of_turn
        else:
            prompts, texts = completion_prompts(body.prompt)
            asked, param = body.max_tokens, "max_tokens"
            logprobs, echo = body.logprobs, bool(body.echo)
            stop_ids = eos
            if asked == 0:
                if not echo:
                    raise APIError(400, "max_tokens 0 returns nothing without echo: give "
                                        "max_tokens >= 1, or echo: true to score the prompt",
                                   param="max_tokens")
                # scoring: the engine computes prompt logprobs while it generates one token,
                # which is then dropped (the OpenAI legacy API's max_tokens 0 with echo)
                asked, score_only = 1, True
        if len(prompts) * (body.n or 1) > MAX_CHOICES:
            raise APIError(400, f"{len(prompts)} prompts times n={body.n or 1} choices; at "
                                f"most {MAX_CHOICES} choices per request", param="n")
        params, prompt_of = [], []
        for p, ids in enumerate(prompts):
            max_tokens = _fit_context(len(ids), asked, context, param)
            for i in range(body.n or 1):
                seed = None if body.seed is None else body.seed + i
                params.append(sampling_params(body, max_tokens, seed))
                prompt_of.append(p)
        options = body.stream_options or {}
        return Job(chat, prompts, texts, params, prompt_of, [] if body.ignore_eos else stop_ids,
                   logprobs, echo, bool(body.stream), bool(options.get("include_usage")),
                   bool(options.get("include_usage") and options.get("continuous_usage_stats")),
                   score_only)

    def completion_prompts(prompt) -> tuple[list[list[int]], list[str | None]]:
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt:
            raise APIError(400, "the prompt is empty: give at least one token", param="prompt")
        if isinstance(prompt[0], int):
            prompt = [prompt]
        if len(prompt) > MAX_CHOICES:
            raise APIError(400, f"prompt: {len(prompt)} prompts; at most {MAX_CHOICES}",
                           param="prompt")
        ids, texts = [], []
        for i, item in enumerate(prompt):
            where = "prompt" if len(prompt) == 1 else f"prompt[{i}]"
            if isinstance(item, str):
                ids.append(bos_prefix + text_ids(item, where, specials=True))
                texts.append(item)
            else:
                ids.append(check_ids(list(item), where))
                texts.append(None)
        return ids, texts

    async def submit_all(job: Job) -> list:
        requests = []
        try:
            for p, params in zip(job.prompt_of, job.params, strict=True):
                requests.append(await engine.submit(
                    job.prompts[p], params, job.eos, logprobs=job.logprobs,
                    prompt_logprobs=job.logprobs if job.echo and job.logprobs is not None
                    else None))
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

    def top_dict(top) -> dict[str, float]:
        out: dict[str, float] = {}
        for token_id, value in top:
            out.setdefault(token_text(token_id), value)
        return out

    def chat_entry(token_id: int, value: float, top) -> dict:
        text = token_text(token_id)
        return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8")),
                "top_logprobs": [{"token": token_text(i), "logprob": v,
                                  "bytes": list(token_text(i).encode("utf-8"))}
                                 for i, v in top]}

    class Choice:
        """One choice's text, tokens and log-probabilities as its events arrive."""

        def __init__(self, index: int, job: Job, request) -> None:
            self.index, self.job, self.request = index, job, request
            self.prompt = job.prompts[job.prompt_of[index]]
            self.text_prompt = job.texts[job.prompt_of[index]]
            self.count, self.finish = 0, None
            self.tokens: list[tuple[int, float, tuple]] = []     # not yet sent (logprobs)
            self.started = False
            self.offset = 0          # text_offset: characters before the next token
            if job.logprobs is not None and not job.chat and not job.echo:
                self.offset = len(self.text_prompt if self.text_prompt is not None
                                  else tokenizer.decode(self.prompt))

        def prompt_part(self) -> tuple[str, dict | None]:
            """With echo: the prompt's text and its completions-shaped logprobs."""
            text = self.text_prompt if self.text_prompt is not None else tokenizer.decode(
                self.prompt)
            if self.job.logprobs is None:
                return text, None
            entries = self.request.prompt_logprob_list or [None] * len(self.prompt)
            pieces = [token_text(i) for i in self.prompt]
            logprobs = {"tokens": pieces,
                        "token_logprobs": [None if e is None else e[0] for e in entries],
                        "top_logprobs": [None if e is None else top_dict(e[1])
                                         for e in entries],
                        "text_offset": self._offsets(pieces)}
            return text, logprobs

        def _offsets(self, pieces: list[str]) -> list[int]:
            out = []
            for piece in pieces:
                out.append(self.offset)
                self.offset += len(piece)
            return out

        def take(self) -> dict | None:
            """Logprobs of the tokens since the last call, in this endpoint's shape."""
            if self.job.logprobs is None:
                return None
            tokens, self.tokens = self.tokens, []
            if self.job.chat:
                return {"content": [chat_entry(i, v, t) for i, v, t in tokens]}
            pieces = [token_text(i) for i, _, _ in tokens]
            return {"tokens": pieces, "token_logprobs": [v for _, v, _ in tokens],
                    "top_logprobs": [top_dict(t) for _, _, t in tokens],
                    "text_offset": self._offsets(pieces)}

        def add(self, event) -> None:
            if self.job.score_only:             # the token generated to score the prompt
                self.finish = "length" if event.finish_reason is not None else None
                return
            if event.token_id is not None:
                self.count += 1
                if event.logprob is not None:      # the end-of-text token's too (vLLM's)
                    self.tokens.append((event.token_id, event.logprob, event.top_logprobs))
            self.finish = event.finish_reason

    def failure(event) -> APIError | None:
        if event.finish_reason == "error":
            return APIError(500, event.error or "generation failed", kind="server_error")
        if event.finish_reason == "cancelled":
            return APIError(503, "the request was cancelled: the server is shutting down",
                            kind="service_unavailable")
        return None

    def usage(job: Job, choices: list[Choice]) -> dict:
        prompt_tokens = sum(len(ids) for ids in job.prompts)
        completion = sum(c.count for c in choices)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                "total_tokens": prompt_tokens + completion}

    async def whole(job: Job, requests: list, ident: str, stamp: int) -> dict:
        choices = [Choice(i, job, r) for i, r in enumerate(requests)]
        out = []
        try:
            for choice in choices:
                pieces = []
                async for event in choice.request:
                    problem = failure(event)
                    if problem is not None:
                        raise problem
                    choice.add(event)
                    if not job.score_only:
                        pieces.append(event.text)
                text = "".join(pieces)
                if job.chat:
                    item = {"index": choice.index, "message": {"role": "assistant",
                                                                "content": text},
                            "logprobs": choice.take(), "finish_reason": choice.finish}
                else:
                    logprobs = None
                    if job.echo:
                        head, head_logprobs = choice.prompt_part()
                        text = head + text
                        logprobs = head_logprobs
                    tail = choice.take()
                    if logprobs is not None and tail is not None:
                        logprobs = {k: logprobs[k] + tail[k] for k in logprobs}
                    item = {"index": choice.index, "text": text, "logprobs": logprobs or tail,
                            "finish_reason": choice.finish}
                out.append(item)
        finally:
            for request in requests:
                request.cancel()
        return {"id": ident, "object": "chat.completion" if job.chat else "text_completion",
                "created": stamp, "model": model_id, "choices": out,
                "usage": usage(job, choices)}

    async def events(job: Job, requests: list, ident: str, stamp: int):
        choices = [Choice(i, job, r) for i, r in enumerate(requests)]
        kind = "chat.completion.chunk" if job.chat else "text_completion"

        def frame(choice_body: dict | None, **extra) -> str:
            body = {"id": ident, "object": kind, "created": stamp, "model": model_id,
                    "choices": [] if choice_body is None else [choice_body], **extra}
            if job.continuous_usage and choice_body is not None:
                body["usage"] = usage(job, choices)
            return f"data: {json.dumps(body)}\n\n"

        def piece(choice: Choice, text: str, finish: str | None, first: bool = False) -> dict:
            if job.chat:
                delta = {"role": "assistant", "content": ""} if first else (
                    {"content": text} if text else {})
                return {"index": choice.index, "delta": delta,
                        "logprobs": None if first else choice.take(), "finish_reason": finish}
            return {"index": choice.index, "text": text, "logprobs": choice.take(),
                    "finish_reason": finish}

        queue: asyncio.Queue = asyncio.Queue()

        async def pump(choice: Choice) -> None:
            async for event in choice.request:
                await queue.put((choice, event))
            await queue.put((choice, None))

        tasks = [asyncio.create_task(pump(c)) for c in choices]
        try:
            if job.chat:
                for choice in choices:
                    yield frame(piece(choice, "", None, first=True))
            open_choices = len(choices)
            while open_choices:
                choice, event = await queue.get()
                if event is None:
                    open_choices -= 1
                    continue
                problem = failure(event)
                if problem is not None:
                    yield f"data: {json.dumps(problem.body())}\n\n"
                    return
                if job.echo and not choice.started:     # prompt logprobs are known now
                    head, head_logprobs = choice.prompt_part()
                    yield frame({"index": choice.index, "text": head, "logprobs": head_logprobs,
                                 "finish_reason": None})
                choice.started = True
                choice.add(event)
                text = "" if job.score_only else event.text
                finish = choice.finish if job.score_only else (
                    event.finish_reason if event.finish_reason in ("stop", "length") else None)
                if text or finish or choice.tokens:
                    yield frame(piece(choice, text, finish))
            if job.include_usage:
                yield frame(None, usage=usage(job, choices))
            yield "data: [DONE]\n\n"
        finally:
            for request in requests:
                request.cancel()      # the client went away, or we are done: free the engine
            for task in tasks:
                task.cancel()

    async def generate(request: HTTPRequest, chat: bool):
        job = await off_loop(prepare, await read_body(request), chat)
        requests = await submit_all(job)
        stamp, ident = int(time.time()), f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        if job.stream:
            return StreamingResponse(events(job, requests, ident, stamp),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await whole(job, requests, ident, stamp)

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest):
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HTTPRequest):
        return await generate(request, chat=True)

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
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="split the model over N local ranks (tinygpt.parallel; gloo on a "
                             "CPU, NCCL on GPUs); N must divide the heads (default 1)")
    parser.add_argument("--kv-blocks", type=int, default=None,
                        help="KV-cache blocks of 16 positions (default: room for --max-running "
                             "sequences of 512 positions)")
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
    parser.add_argument("--quantize", choices=tuple(QUANTIZE), default=None,
                        help="serve weight-only quantized weights: int8 (per row) or int4 "
                             "(groups of 32), see tinygpt.quant (default: as loaded)")
    return parser


def timed_h11(header_timeout: float):
    """uvicorn's h11 protocol, closing a connection whose request headers have not all
    arrived `header_timeout` seconds after it opened (or after its last response): uvicorn
    itself times out only idle keep-alive connections, so a client that sends its headers a
    byte at a time would hold its connection forever."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class TimedH11(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm_header_timer()

        def on_response_complete(self) -> None:
            finished = self.cycle
            super().on_response_complete()
            # uvicorn starts a pipelined request (one whose headers already came) in there:
            # its headers are in, so no timer; a timer armed with its cycle would close the
            # connection in the middle of its answer
            if self.cycle is finished:
                self._arm_header_timer()

        def _arm_header_timer(self) -> None:
            self._headers_due = self.loop.call_later(header_timeout, self._headers_late,
                                                     self.cycle)

        def _headers_late(self, cycle_then) -> None:
            # a request whose headers arrived since the timer was armed has a new cycle
            if self.cycle is cycle_then and not self.transport.is_closing():
                self.transport.close()

    return TimedH11


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
    if args.quantize is not None:
        from tinygpt.quant import quantize_model

        model = quantize_model(model.eval(), QUANTIZE[args.quantize])
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
