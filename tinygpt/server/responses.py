"""The engine's events in OpenAI's shapes: a whole completion or chat reply (`whole`), or the
same as server-sent events (`events`), with each choice's text, finish reason, usage and
log-probabilities (completions': tokens, token_logprobs, top_logprobs, text_offset; chat's:
content entries with bytes). A choice gathers its events in a Choice; an error event ends the
response with an OpenAI error body (before the 200 when it is not streamed; streamed, as an
event followed by "data: [DONE]", as vLLM's, so that clients waiting for it end). A whole
response is gathered on the event loop, then built and serialized on a worker thread
(`answer`): echo with logprobs makes megabytes of JSON (37 MB held /health back a second
when it was built on the loop), and the loop keeps serving the other requests meanwhile; a
stream's echoed prompt is built on a worker thread too (`events`).

A token's text is its own decode, so a byte token of a character cut in pieces shows as U+FFFD;
its `bytes` (chat) are its own bytes (`token_bytes`), and its text_offset is the number of
characters of the returned text that are whole before its first byte (`TextOffsets`: every
byte of "é" is at 0; an echoed text prompt's added BOS, which that text leaves out, is at
0). In completions' top_logprobs, a dict keyed by text, alternatives with the same text
(several byte tokens shown as U+FFFD) share one key, which holds the most probable of them.

A chat reply read for tool calls (tinygpt.server.tools) that turns out to be calls becomes a
message with tool_calls and finish_reason "tool_calls"; streamed, it is held back while it may
still become calls, then sent as each call's id and name and then its arguments. One that
max_tokens cut while it was writing calls (always, for a reply held to calls; for "auto",
once it began with the tag) is a message with content null, the calls begun in tool_calls
(the last with its arguments so far, tools.cut_tool_calls) and finish_reason "length", whole
or streamed alike, as OpenAI's. One that a stop string cut while the grammar held it to calls
is read the same way and keeps finish_reason "stop" (not "tool_calls": the last call's
arguments may be cut), never as the format's markup in content."""

from __future__ import annotations

import asyncio
import codecs
import json

from fastapi.responses import JSONResponse

from tinygpt.server.prompts import Job, Prompts
from tinygpt.server.protocol import APIError
from tinygpt.server.tools import CALL_OPEN, cut_tool_calls, may_be_calls, parse_tool_calls


def token_bytes(prompts: Prompts, token_id: int) -> bytes:
    """A token's own bytes (every tinygpt tokenizer has token_bytes, a Hugging Face folder's
    too); a tokenizer without them gives the UTF-8 of its text."""
    own = getattr(prompts.tokenizer, "token_bytes", None)
    if own is None:
        return prompts.token_text(token_id).encode("utf-8")
    return own([token_id])[0]


def continues(pending: bytes, byte: bytes) -> bool:
    """Whether `byte` continues the unfinished UTF-8 character `pending` (a valid start)."""
    try:
        codecs.getincrementaldecoder("utf-8")("strict").decode(pending + byte)
    except UnicodeDecodeError:
        return False
    return True


class TextOffsets:
    """text_offset, one token at a time, over tokens whose text is their bytes decoded as UTF-8
    (errors replaced, as the tokenizers decode). next(bytes) gives `start` plus the number of
    characters that are whole before the token's first byte: a character cut between tokens
    counts once its last byte is in, so each of its bytes is at its own offset; bytes that
    turn out not to be a character (a U+FFFD in the text) count once the next byte shows it."""

    def __init__(self, start: int = 0) -> None:
        self.start, self.whole = start, 0
        self.utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def next(self, data: bytes) -> int:
        pending = self.utf8.getstate()[0]
        cut = bool(pending) and bool(data) and not continues(pending, data[:1])   # a U+FFFD
        offset = self.start + self.whole + (1 if cut else 0)
        self.whole += len(self.utf8.decode(data))
        return offset


class Choice:
    """One choice's text, tokens and log-probabilities as its events arrive."""

    def __init__(self, index: int, job: Job, request, prompts: Prompts) -> None:
        self.index, self.job, self.request, self.prompts = index, job, request, prompts
        self.prompt = job.prompts[job.prompt_of[index]]
        self.text_prompt = job.texts[job.prompt_of[index]]
        self.count, self.finish = 0, None
        self.tokens: list[tuple[int, float, tuple]] = []     # not yet sent (logprobs)
        self.started = False
        self.holding, self.held = job.reads != "text", ""     # text that may be tool calls
        self.offsets: TextOffsets | None = None     # the reply's text_offset, once needed

    def prompt_text(self) -> str:
        return self.text_prompt if self.text_prompt is not None else \
            self.prompts.tokenizer.decode(self.prompt)

    def reply_offsets(self) -> TextOffsets:
        """The reply's offsets, which start where the prompt's text ends (echoed or not)."""
        if self.offsets is None:
            self.offsets = TextOffsets(len(self.prompt_text()))
        return self.offsets

    def prompt_part(self) -> tuple[str, dict | None]:
        """With echo: the prompt's text and its completions-shaped logprobs. The BOS the
        server put before a text prompt (Prompts.bos_prefix) is among the tokens but not in
        the echoed text: it is at offset 0 and takes up no characters, so each offset stays
        where its token's text is in the returned text."""
        text = self.prompt_text()
        self.offsets = TextOffsets(len(text))
        if self.job.logprobs is None:
            return text, None
        entries = self.request.prompt_logprob_list or [None] * len(self.prompt)
        added = len(self.prompts.bos_prefix) if self.text_prompt is not None else 0
        offsets = TextOffsets()
        logprobs = {"tokens": [self.prompts.token_text(i) for i in self.prompt],
                    "token_logprobs": [None if e is None else e[0] for e in entries],
                    "top_logprobs": [None if e is None else self._top_dict(e[1])
                                     for e in entries],
                    "text_offset": [0] * added + [offsets.next(token_bytes(self.prompts, i))
                                                  for i in self.prompt[added:]]}
        return text, logprobs

    def _top_dict(self, top) -> dict[str, float]:
        """{text: logprob}; alternatives with the same text keep the most probable."""
        out: dict[str, float] = {}
        for token_id, value in top:
            key = self.prompts.token_text(token_id)
            if key not in out or value > out[key]:
                out[key] = value
        return out

    def _chat_entry(self, token_id: int, value: float, top) -> dict:
        def entry(i: int, v: float) -> dict:
            return {"token": self.prompts.token_text(i), "logprob": v,
                    "bytes": list(token_bytes(self.prompts, i))}
        return {**entry(token_id, value), "top_logprobs": [entry(i, v) for i, v in top]}

    def take(self) -> dict | None:
        """Logprobs of the tokens since the last call, in this endpoint's shape."""
        if self.job.logprobs is None:
            return None
        tokens, self.tokens = self.tokens, []
        if self.job.chat:
            return {"content": [self._chat_entry(i, v, t) for i, v, t in tokens]}
        return {"tokens": [self.prompts.token_text(i) for i, _, _ in tokens],
                "token_logprobs": [v for _, v, _ in tokens],
                "top_logprobs": [self._top_dict(t) for _, _, t in tokens],
                "text_offset": [self.reply_offsets().next(token_bytes(self.prompts, i))
                                for i, _, _ in tokens]}

    def add(self, event) -> None:
        if self.job.score_only:             # the token generated to score the prompt
            self.finish = "length" if event.finish_reason is not None else None
            return
        if event.token_id is not None:
            self.count += 1
            if event.logprob is not None:      # the end-of-text token's too (vLLM's)
                self.tokens.append((event.token_id, event.logprob, event.top_logprobs))
        self.finish = event.finish_reason


def calls_of(job: Job, text: str, finish: str | None) -> tuple[list[dict] | None, str | None]:
    """The calls an ended chat reply read for calls holds (None when it is text) and the
    finish reason to report: the calls in the format, with "tool_calls" for a reply that
    ended on its own; or, for a reply cut while writing calls, the calls begun, with the
    finish reason kept ("length" for max_tokens; "stop" for a stop string, which can cut a
    reply only where the grammar held it to calls: "required", a named function, or "auto"
    once it began with the tag)."""
    if job.reads == "text":
        return None, finish
    calls = parse_tool_calls(text)
    if calls is not None:
        return calls, "tool_calls" if finish == "stop" else finish
    began = text.lstrip().startswith(CALL_OPEN)
    if job.reads == "calls" or (began and (finish == "length" or job.grammar is not None)):
        return cut_tool_calls(text, job.call_name), finish
    return None, finish


def failure(event, job: Job | None = None) -> APIError | None:
    """The error an event ends its request with, if it does (a grammar's, past the engine's
    limits while it generates, names the field that asked for the grammar)."""
    if event.finish_reason == "error":
        if (event.error or "").startswith("GrammarError"):   # the request's grammar, past limits
            return APIError(400, event.error[:1000], code="grammar_error",
                            param=None if job is None else job.grammar_param)
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


async def whole(job: Job, requests: list, ident: str, stamp: int,
                prompts: Prompts) -> JSONResponse:
    """The response of a request that is not streamed, once every choice has ended: its events
    gathered here, on the event loop, the response built and serialized off it (`answer`)."""
    choices = [Choice(i, job, r, prompts) for i, r in enumerate(requests)]
    texts = []
    try:
        for choice in choices:
            pieces = []
            async for event in choice.request:
                problem = failure(event, job)
                if problem is not None:
                    raise problem
                choice.add(event)
                if not job.score_only:
                    pieces.append(event.text)
            texts.append("".join(pieces))
    finally:
        for request in requests:
            request.cancel()
    return await asyncio.to_thread(answer, job, choices, texts, ident, stamp, prompts)


def answer(job: Job, choices: list[Choice], texts: list[str], ident: str, stamp: int,
           prompts: Prompts) -> JSONResponse:
    """The whole response of ended choices and their texts, as JSON (run on a worker thread:
    the decodes of logprobs and echo, and the serializing, can take seconds)."""
    body = {"id": ident, "object": "chat.completion" if job.chat else "text_completion",
            "created": stamp, "model": prompts.model_id,
            "choices": [choice_item(job, c, t) for c, t in zip(choices, texts, strict=True)],
            "usage": usage(job, choices)}
    return JSONResponse(body)


def choice_item(job: Job, choice: Choice, text: str) -> dict:
    """One ended choice of a whole response."""
    if job.chat:
        message = {"role": "assistant", "content": text}
        calls, finish = calls_of(job, text, choice.finish)
        if calls is not None:
            message = {"role": "assistant", "content": None, "tool_calls": calls}
        return {"index": choice.index, "message": message, "logprobs": choice.take(),
                "finish_reason": finish}
    logprobs = None
    if job.echo:
        head, logprobs = choice.prompt_part()
        text = head + text
    tail = choice.take()
    if logprobs is not None and tail is not None:
        logprobs = {k: logprobs[k] + tail[k] for k in logprobs}
    return {"index": choice.index, "text": text, "logprobs": logprobs or tail,
            "finish_reason": choice.finish}


async def events(job: Job, requests: list, ident: str, stamp: int, prompts: Prompts):
    """The response as server-sent events, in the order the choices' tokens arrive: chat sends
    each choice's role first; with echo the prompt comes before a choice's first token; the
    usage when asked for; then "data: [DONE]" (after an error event too, with no usage).
    Leaving early (the client went away) cancels every choice's request."""
    choices = [Choice(i, job, r, prompts) for i, r in enumerate(requests)]
    kind = "chat.completion.chunk" if job.chat else "text_completion"

    def frame(choice_body: dict | None, **extra) -> str:
        body = {"id": ident, "object": kind, "created": stamp, "model": prompts.model_id,
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

    def echo_frame(choice: Choice) -> str:
        """The prompt's text (and logprobs) before a choice's first token: with logprobs,
        megabytes of JSON, so built on a worker thread as a whole response is."""
        head, head_logprobs = choice.prompt_part()
        return frame({"index": choice.index, "text": head, "logprobs": head_logprobs,
                      "finish_reason": None})

    def call_deltas(choice: Choice, calls: list[dict]):
        """A reply's calls as OpenAI streams them: each call's id and name, then its
        arguments."""
        for number, call in enumerate(calls):
            head = {"index": number, "id": call["id"], "type": "function",
                    "function": {"name": call["function"]["name"], "arguments": ""}}
            tail = {"index": number, "function": {"arguments": call["function"]["arguments"]}}
            for delta in (head, tail):
                yield {"index": choice.index, "delta": {"tool_calls": [delta]},
                       "logprobs": None, "finish_reason": None}

    async def arrivals():
        """(choice, event) in the order the engine's tokens arrive, until every choice ends.
        One choice (most requests) reads its request directly: no task, no second queue."""
        if len(choices) == 1:
            async for event in choices[0].request:
                yield choices[0], event
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(choice: Choice) -> None:
            async for event in choice.request:
                await queue.put((choice, event))
            await queue.put((choice, None))

        tasks = [asyncio.create_task(pump(c)) for c in choices]
        try:
            open_choices = len(choices)
            while open_choices:
                choice, event = await queue.get()
                if event is None:
                    open_choices -= 1
                else:
                    yield choice, event
        finally:
            for task in tasks:
                task.cancel()

    stream = arrivals()
    try:
        if job.chat:
            for choice in choices:
                yield frame(piece(choice, "", None, first=True))
        async for choice, event in stream:
            problem = failure(event, job)
            if problem is not None:
                yield f"data: {json.dumps(problem.body())}\n\n"
                yield "data: [DONE]\n\n"
                return
            if job.echo and not choice.started:     # prompt logprobs are known now
                yield await asyncio.to_thread(echo_frame, choice)
            choice.started = True
            choice.add(event)
            text = "" if job.score_only else event.text
            finish = choice.finish if job.score_only else (
                event.finish_reason if event.finish_reason in ("stop", "length") else None)
            if choice.holding:              # a reply that may be tool calls waits whole
                choice.held += text
                if not may_be_calls(choice.held):
                    choice.holding, text, choice.held = False, choice.held, ""
                elif finish is None:
                    continue
                else:
                    calls, finish = calls_of(job, choice.held, finish)
                    if calls is not None:
                        for body in call_deltas(choice, calls):
                            yield frame(body)
                        text = ""
                    else:
                        text = choice.held
            if text or finish or choice.tokens:
                yield frame(piece(choice, text, finish))
        if job.include_usage:
            yield frame(None, usage=usage(job, choices))
        yield "data: [DONE]\n\n"
    finally:
        for request in requests:
            request.cancel()      # the client went away, or we are done: free the engine
        await stream.aclose()     # (its pumps too, when it has them)
