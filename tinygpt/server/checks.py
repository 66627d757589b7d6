"""The checks every request passes before it touches the model, shared by the endpoints: the
body as JSON (parse_json), against its pydantic model (validate, with first_error reading
pydantic's errors back to the request's own paths), lists too long for any valid request
(too_long), the model's name (check_model), the fields that must be in range or are not
implemented (check_common), each chat message against OpenAI's rules (check_message), the
prompt and max_tokens against the context or the KV pool (fit_context), what echo may return
(bound_echo), and the sampling settings (sampling_params). Each failure is an APIError naming
the field: a 400; a 422 for a body that is not a JSON object, a required field missing or a
field of the wrong type; a 404 (model_not_found) for another model."""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import BaseModel, ValidationError

from tinygpt.server import protocol
from tinygpt.server.protocol import (
    COMPLETION_MAX_TOKENS,
    MAX_CHOICES,
    MAX_ECHO_ENTRIES,
    MAX_LOGPROBS,
    MAX_N,
    MAX_SEED,
    MAX_STOP_CHARS,
    MESSAGE_ROLES,
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
    """A pydantic model from parsed JSON; APIError 422 naming the first bad field by its path
    in the request and saying what the field accepts (first_error)."""
    if not isinstance(data, dict):
        raise APIError(422, f"the body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as err:
        where, message = first_error(err.errors())
        raise APIError(422, message, param=where) from None
    except (ValueError, TypeError, OverflowError, RecursionError) as err:
        raise APIError(422, f"the body does not fit the schema: {err}") from None


# pydantic reports a field that takes several types (a union) once per type it tried, each
# error's location holding that type's name ("str", "list[int]", "ToolChoice") after the
# field's path. A segment that names no field of protocol.py's models is such a name.
FIELD_NAMES = frozenset(field.alias or name for model in vars(protocol).values()
                        if isinstance(model, type) and issubclass(model, BaseModel)
                        for name, field in model.model_fields.items())
# what a union field accepts, by its path (list indexes as N), for a value none of its types
# takes; any other field's words come from pydantic's error types (TYPE_WORDS)
ACCEPTS = {
    "prompt": "a string, a list of strings, a list of token ids or a list of lists of token "
              "ids",
    "prompt.N": "a string, a token id (an integer) or a list of token ids",
    "stop": "a string or a list of strings",
    "logprobs": f"an integer 0-{MAX_LOGPROBS} or false",
    "messages.N.content": 'a string or a list of parts ({"type": "text", "text": ...})',
    "tool_choice": '"none", "auto", "required" or {"type": "function", "function": '
                   '{"name": ...}}',
}
TYPE_WORDS = {"string_type": "a string", "int_type": "an integer", "float_type": "a number",
              "bool_type": "a boolean", "list_type": "a list", "dict_type": "an object",
              "model_type": "an object", "finite_number": "a finite number"}


def _is_member(segment: Any) -> bool:
    return isinstance(segment, str) and segment not in FIELD_NAMES


def _path(loc: tuple) -> str:
    return ".".join(str(segment) for segment in loc if not _is_member(segment))


def _shown(value: Any) -> str:
    """A value as the request wrote it, short: a container by its kind only."""
    if isinstance(value, list | dict):
        return "a list" if isinstance(value, list) else "an object"
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 40 else text[:37] + "..."


def first_error(errors: list[dict]) -> tuple[str | None, str]:
    """(param, message) for pydantic's errors (ValidationError.errors()): the first one, at
    its path in the request. Where the path runs through a union, the types whose errors lie
    inside the value took its JSON type (a list given for a string or a list is judged as a
    list); the one that got furthest is followed to the deepest part that is wrong. When none
    took it, or several got equally far, the message lists what each would have taken."""
    loc = tuple(errors[0]["loc"])
    while (k := next((i for i, seg in enumerate(loc) if _is_member(seg)), None)) is not None:
        members: dict[str, list[dict]] = {}      # each type tried: its errors, type name left out
        for error in errors:
            at = tuple(error["loc"])
            if at[:k] == loc[:k] and len(at) > k and _is_member(at[k]):
                members.setdefault(at[k], []).append({**error, "loc": at[:k] + at[k + 1:]})
        reached = {name: _progress(found[0]["loc"][k:]) for name, found in members.items()
                   if len(found[0]["loc"]) > k}
        best = max(reached.values(), default=None)
        leaders = [name for name, progress in reached.items() if progress == best]
        if len(leaders) != 1:
            tried = [members[name][0] for name in leaders or members]
            return _path(tried[0]["loc"]), _expected(tried, union=True)
        errors = members[leaders[0]]
        loc = tuple(errors[0]["loc"])
    return _path(loc) or None, _expected(errors[:1], union=False)


def _progress(inside: tuple) -> tuple[int, int]:
    """How far a type got into a value: the list index it failed at, then the depth."""
    index = next((seg for seg in inside if isinstance(seg, int)), -1)
    return index, len(inside)


def _expected(tried: list[dict], union: bool) -> str:
    """The message for errors at one path, one per type tried there; a union field's words
    from ACCEPTS."""
    first = tried[0]
    where = _path(tuple(first["loc"]))
    if first["type"] == "missing":
        return f"{where} is required"
    words = ACCEPTS.get(re.sub(r"\.[0-9]+(?=\.|$)", ".N", where)) if union else None
    if words is None:
        known = [TYPE_WORDS.get(error["type"]) for error in tried]
        if None in known:
            return f"{where}: {first['msg']}" if where else str(first["msg"])
        known = list(dict.fromkeys(known))
        words = " or ".join([", ".join(known[:-1]), known[-1]] if len(known) > 1 else known)
    return f"{where} must be {words}, got {_shown(first.get('input'))}"


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


def check_model(name: str | None, model_id: str) -> None:
    """APIError 404 (OpenAI's model_not_found) for a model other than the one served."""
    if name is not None and name != model_id:
        raise APIError(404, f"the model {name!r} is not served here; this server serves "
                            f"{model_id!r}", param="model", code="model_not_found")


def check_common(body, chat: bool, model_id: str = MODEL_ID) -> None:
    """The fields of a generation request that do not need the tokenizer: unknown fields (at
    the top level and in the objects held_to_fields names), the model's name, n, best_of,
    seed, what is not implemented, stream_options, logprobs (the reply's shape,
    response_format and tools, is structured.reply_shape's)."""
    refuse_unknown(body)
    for where, part in held_to_fields(body):
        refuse_unknown(part, where)
    check_model(body.model, model_id)
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


def check_message(i: int, message) -> None:
    """OpenAI's rules for the i-th chat message (a protocol.Message), each broken one a 400
    naming the field: a role of MESSAGE_ROLES; content (a string or a non-empty list of parts,
    a text part with its text) on every message but an assistant's that makes calls; a tool
    message's tool_call_id. Keys beyond those the message class knows are not looked at."""
    where, role, content = f"messages.{i}", message.role, message.content
    if role not in MESSAGE_ROLES:
        raise APIError(400, f"{where}.role must be one of {list(MESSAGE_ROLES)}, got {role!r}",
                       param=f"{where}.role")
    if content is None and not (role == "assistant" and message.tool_calls):
        needs = ("content or tool_calls (at least one call)" if role == "assistant" else
                 "content: a string or a non-empty list of parts")
        raise APIError(400, f"{where}.content: a {role} message needs {needs}",
                       param=f"{where}.content")
    if content == []:
        raise APIError(400, f"{where}.content: a list of parts must hold at least one part (or "
                            f"give a string)", param=f"{where}.content")
    for j, part in enumerate(content if isinstance(content, list) else ()):
        if part.type == "text" and part.text is None:
            raise APIError(400, f"{where}.content.{j}.text is required: a text part is "
                                f'{{"type": "text", "text": "..."}}',
                           param=f"{where}.content.{j}.text")
    if role == "tool" and message.tool_call_id is None:
        raise APIError(400, f"{where}.tool_call_id is required: a tool message answers the call "
                            f"with that id", param=f"{where}.tool_call_id")


def fit_context(prompt_len: int, max_tokens: int | None, context: int,
                param: str = "max_tokens", default: int | None = COMPLETION_MAX_TOKENS, *,
                pool: int | None = None, prompt_param: str = "prompt") -> int:
    """The tokens to generate for a prompt of prompt_len: max_tokens, refused when the prompt
    and it do not fit; when it is not given, `default` tokens (/v1/completions' 16) or, with
    default None (chat's), the rest, and never more than the rest. What must fit is the
    model's context, or, when it is smaller, `pool`: the positions the engine's KV pool holds
    for one request (the errors then say so, and that --kv-blocks raises it). prompt_param
    names the field the prompt came from ("messages" for a chat)."""
    if prompt_len == 0:
        raise APIError(400, "the prompt is empty: give at least one token", param=prompt_param)
    limit, holds = context, f"the model's context is {context}"
    if pool is not None and pool < context:
        limit = pool
        holds = (f"the server's KV pool holds {pool} positions for one request (the model's "
                 f"context is {context}; --kv-blocks raises the pool)")
    if prompt_len >= limit:
        raise APIError(400, f"{prompt_param}: the prompt has {prompt_len} tokens; {holds}, so a "
                            f"prompt may have at most {limit - 1}",
                       param=prompt_param, code="context_length_exceeded")
    if max_tokens is None:
        rest = limit - prompt_len
        return rest if default is None else min(default, rest)
    if max_tokens < 1:
        raise APIError(400, f"{param} must be >= 1, got {max_tokens}", param=param)
    if prompt_len + max_tokens > limit:
        raise APIError(400, f"{param} too large: the prompt's {prompt_len} tokens plus "
                            f"{param} {max_tokens} exceed {limit} (at most "
                            f"{limit - prompt_len}): {holds}", param=param,
                       code="context_length_exceeded")
    return max_tokens


def bound_echo(prompt_lens: list[int], n: int, logprobs: int | None, echo: bool) -> None:
    """Refuse (400) a completion whose echoed prompt log-probabilities would hold more than
    MAX_ECHO_ENTRIES entries: each echoed token has its own and logprobs alternatives, for
    every prompt and each of its n choices. What a request may make the server write stays
    bounded; one prompt of a whole 8,192-token context with logprobs 20 is 172,011."""
    if not echo or logprobs is None:
        return
    entries = sum(prompt_lens) * n * (logprobs + 1)
    if entries > MAX_ECHO_ENTRIES:
        raise APIError(400, f"logprobs: echo with logprobs {logprobs} would return {entries} "
                            f"log-probabilities ({sum(prompt_lens)} prompt tokens x n={n} x "
                            f"{logprobs + 1}); a request may return at most {MAX_ECHO_ENTRIES} "
                            f"for its prompts: lower logprobs or n, or send fewer tokens",
                       param="logprobs")


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
