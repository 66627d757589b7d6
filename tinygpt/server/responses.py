"""The engine's events in OpenAI's shapes: a whole completion or chat reply (`whole`), or the
same as server-sent events (`events`), with each choice's text, finish reason, usage and
log-probabilities (completions': tokens, token_logprobs, top_logprobs, text_offset; chat's:
content entries with bytes). A choice gathers its events in a Choice; an error event ends the
response with an OpenAI error body (before the 200 when it is not streamed, as the stream's
last event when it is). A chat reply read for tool calls (tinygpt.server.tools) that turns
out to be calls becomes a message with tool_calls and finish_reason "tool_calls"; streamed,
it is held back while it may still become calls, then sent as each call's id and name and
then its arguments. One that max_tokens cut while it was writing calls (always, for a reply
held to calls; for "auto", once it began with the tag) is a message with content null, the
calls begun in tool_calls (the last with its arguments so far, tools.cut_tool_calls) and
finish_reason "length", whole or streamed alike, as OpenAI's."""

from __future__ import annotations

import asyncio
import json

from tinygpt.server.prompts import Job, Prompts
from tinygpt.server.protocol import APIError
from tinygpt.server.tools import CALL_OPEN, cut_tool_calls, may_be_calls, parse_tool_calls


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
        self.offset = 0          # text_offset: characters before the next token
        if job.logprobs is not None and not job.chat and not job.echo:
            self.offset = len(self.text_prompt if self.text_prompt is not None
                              else prompts.tokenizer.decode(self.prompt))

    def prompt_part(self) -> tuple[str, dict | None]:
        """With echo: the prompt's text and its completions-shaped logprobs."""
        text = self.text_prompt if self.text_prompt is not None else \
            self.prompts.tokenizer.decode(self.prompt)
        if self.job.logprobs is None:
            return text, None
        entries = self.request.prompt_logprob_list or [None] * len(self.prompt)
        pieces = [self.prompts.token_text(i) for i in self.prompt]
        logprobs = {"tokens": pieces,
                    "token_logprobs": [None if e is None else e[0] for e in entries],
                    "top_logprobs": [None if e is None else self._top_dict(e[1])
                                     for e in entries],
                    "text_offset": self._offsets(pieces)}
        return text, logprobs

    def _offsets(self, pieces: list[str]) -> list[int]:
        out = []
        for piece in pieces:
            out.append(self.offset)
            self.offset += len(piece)
        return out

    def _top_dict(self, top) -> dict[str, float]:
        out: dict[str, float] = {}
        for token_id, value in top:
            out.setdefault(self.prompts.token_text(token_id), value)
        return out

    def _chat_entry(self, token_id: int, value: float, top) -> dict:
        text = self.prompts.token_text
        return {"token": text(token_id), "logprob": value,
                "bytes": list(text(token_id).encode("utf-8")),
                "top_logprobs": [{"token": text(i), "logprob": v,
                                  "bytes": list(text(i).encode("utf-8"))} for i, v in top]}

    def take(self) -> dict | None:
        """Logprobs of the tokens since the last call, in this endpoint's shape."""
        if self.job.logprobs is None:
            return None
        tokens, self.tokens = self.tokens, []
        if self.job.chat:
            return {"content": [self._chat_entry(i, v, t) for i, v, t in tokens]}
        pieces = [self.prompts.token_text(i) for i, _, _ in tokens]
        return {"tokens": pieces, "token_logprobs": [v for _, v, _ in tokens],
                "top_logprobs": [self._top_dict(t) for _, _, t in tokens],
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


def calls_of(job: Job, text: str, finish: str | None) -> list[dict] | None:
    """The calls a chat reply read for calls holds, or None when it is text: the calls in the
    format; or, cut by max_tokens while writing calls, the calls begun."""
    if job.reads == "text":
        return None
    calls = parse_tool_calls(text)
    if calls is None and finish == "length" and (
            job.reads == "calls" or text.lstrip().startswith(CALL_OPEN)):
        calls = cut_tool_calls(text, job.call_name)
    return calls


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


async def whole(job: Job, requests: list, ident: str, stamp: int, prompts: Prompts) -> dict:
    """The response of a request that is not streamed, once every choice has ended."""
    choices = [Choice(i, job, r, prompts) for i, r in enumerate(requests)]
    out = []
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
            text = "".join(pieces)
            if job.chat:
                message, finish = {"role": "assistant", "content": text}, choice.finish
                calls = calls_of(job, text, finish)
                if calls is not None:
                    message = {"role": "assistant", "content": None, "tool_calls": calls}
                    finish = "tool_calls" if finish == "stop" else finish
                item = {"index": choice.index, "message": message, "logprobs": choice.take(),
                        "finish_reason": finish}
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
            "created": stamp, "model": prompts.model_id, "choices": out,
            "usage": usage(job, choices)}


async def events(job: Job, requests: list, ident: str, stamp: int, prompts: Prompts):
    """The response as server-sent events, in the order the choices' tokens arrive: chat sends
    each choice's role first; with echo the prompt comes before a choice's first token; the
    usage when asked for; then "data: [DONE]". Leaving early (the client went away) cancels
    every choice's request."""
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
            if choice.holding:              # a reply that may be tool calls waits whole
                choice.held += text
                if not may_be_calls(choice.held):
                    choice.holding, text, choice.held = False, choice.held, ""
                elif finish is None:
                    continue
                else:
                    calls = calls_of(job, choice.held, finish)
                    if calls is not None:
                        for body in call_deltas(choice, calls):
                            yield frame(body)
                        text, finish = "", "tool_calls" if finish == "stop" else finish
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
