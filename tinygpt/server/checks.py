"""The checks every request passes before it touches the model, shared by the endpoints: the
body as JSON (parse_json), against its pydantic model (validate), lists too long for any valid
request (too_long), the fields that must be in range or are not implemented (check_common),
the prompt and max_tokens against the context (fit_context), and the sampling settings
(sampling_params). Each failure is an APIError naming the field: a 400; a 422 for a body that
is not a JSON object, a required field missing or a field of the wrong type; a 404 for another
model."""

from __future__ import annotations

import json
import re
from typing import Any

from tinygpt.server.protocol import (
    MAX_CHOICES,
    MAX_LOGPROBS,
    MAX_N,
    MAX_SEED,
    MAX_STOP_CHARS,
    MODEL_ID,
    APIError,
)

SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _no_constant(name: str):
    raise APIError(400, f"the body is not valid JSON: {name} is not a JSON number")


def parse_json(raw: bytes | str) -> Any:
    """The body as JSON; APIError 400 for anything JSON (RFC 8259) does not allow (NaN and
    Infinity included), integers of more than 4300 digits, and strings with lone surrogates
    (not Unicode text). A number with a fraction or an exponent too large for a double parses
    to infinity: a field that takes a number refuses it (validate: 422), and a field that
    takes an object (metadata, a schema) keeps it as it is."""
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


def too_long(data: Any, context: int) -> None:
    """Refuse lists no valid request has before validating them item by item (a list of a
    million token ids costs pydantic a quarter of a second)."""
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


def bounded(name: str, value, low, high):
    if value is not None and not low <= value <= high:
        raise APIError(400, f"{name} must be in [{low}, {high}], got {value}", param=name)
    return value


def refuse_unknown(model, where: str = "") -> None:
    """APIError 400 naming the fields of the parsed object `model` (a pydantic model kept with
    extra="allow") that its class does not know: at the body's top level (where ""), or inside
    it at the path `where` ("structured_outputs" -> "structured_outputs.whitespace_pattern")."""
    unknown = sorted(set(model.model_extra or {}))
    if unknown:
        names = [f"{where}.{name}" for name in unknown] if where else unknown
        fields = sorted(field.alias or name for name, field in type(model).model_fields.items())
        raise APIError(400, f"unsupported field(s) {names}; {where or 'this server'} supports "
                            f"{fields}", param=names[0])


def held_to_fields(body):
    """(path, object) for each object inside a generation request whose unknown fields are
    refused as the body's own are: response_format and its json_schema, structured_outputs,
    each tool and its function, and a tool_choice naming a function. Chat messages (their
    content parts and tool calls too) are deliberately not among them: clients send an
    assistant reply back in the conversation as they got it (the openai SDK's message holds
    refusal, annotations, audio, function_call), so keys a message has beyond role, content,
    name, tool_call_id and tool_calls are accepted and ignored."""
    fmt = body.response_format
    if fmt is not None:
        yield "response_format", fmt
        if fmt.json_schema is not None:
            yield "response_format.json_schema", fmt.json_schema
    if body.structured_outputs is not None:
        yield "structured_outputs", body.structured_outputs
    if "tools" not in type(body).model_fields:          # /v1/completions
        return
    for i, tool in enumerate(body.tools or ()):
        yield f"tools[{i}]", tool
        yield f"tools[{i}].function", tool.function
    choice = body.tool_choice
    if choice is not None and not isinstance(choice, str):
        yield "tool_choice", choice
        yield "tool_choice.function", choice.function


def check_common(body, chat: bool, model_id: str = MODEL_ID) -> None:
    """The fields of a generation request that do not need the tokenizer: unknown fields (at
    the top level and in the objects held_to_fields names), the model's name, n, best_of,
    seed, what is not implemented, stream_options, logprobs (the reply's shape,
    response_format and tools, is structured.reply_shape's)."""
    refuse_unknown(body)
    for where, part in held_to_fields(body):
        refuse_unknown(part, where)
    if body.model is not None and body.model != model_id:
        raise APIError(404, f"the model {body.model!r} does not exist; this server serves "
                            f"{model_id!r}", param="model", code="model_not_found")
    bounded("n", body.n, 1, MAX_N)
    if body.best_of is not None and body.best_of != (body.n or 1):
        raise APIError(400, f"best_of must equal n (ranking candidates is not implemented), got "
                            f"best_of={body.best_of} n={body.n or 1}", param="best_of")
    bounded("seed", body.seed, 0, MAX_SEED)
    if body.logit_bias:
        raise APIError(400, "logit_bias is not implemented", param="logit_bias")
    if body.stream_options is not None:
        if not body.stream:
            raise APIError(400, "stream_options needs stream: true", param="stream_options")
        options = body.stream_options
        extra = set(options) - {"include_usage", "continuous_usage_stats"}
        if extra or not all(isinstance(options.get(name, False), bool) for name in options):
            raise APIError(400, "stream_options takes include_usage and vLLM's "
                                "continuous_usage_stats (true / false)", param="stream_options")
    if chat:
        if body.logprobs:
            bounded("top_logprobs", body.top_logprobs, 0, MAX_LOGPROBS)
        elif body.top_logprobs is not None:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    else:
        if body.logprobs is False:
            body.logprobs = None
        if body.logprobs is True:
            raise APIError(400, f"logprobs: give how many alternatives per token (an int in "
                                f"[0, {MAX_LOGPROBS}]), got true", param="logprobs")
        bounded("logprobs", body.logprobs, 0, MAX_LOGPROBS)
        if body.suffix:
            raise APIError(400, "suffix (insertion) is not implemented", param="suffix")


def fit_context(prompt_len: int, max_tokens: int | None, context: int,
                param: str = "max_tokens") -> int:
    """The tokens to generate for a prompt of prompt_len: max_tokens (default 16, or what
    is left of the context), refused when the prompt and it do not fit."""
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
        bounded(name, getattr(body, name), -2, 2)
    top_k = body.top_k
    if top_k == -1:              # vLLM's "off"
        top_k = 0
    bounded("top_k", top_k, 0, 1 << 31)
    bounded("temperature", body.temperature, 0, 1e6)
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
