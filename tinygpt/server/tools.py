"""Tool calls for a model whose chat template knows no tools: how the tools go into the prompt,
how earlier calls and their results are written back into the conversation, and how calls are
read out of the reply. SmolLM2's template (and the shipped model's) has only system, user and
assistant turns, so the server writes tools as text, in one documented format:

* The tools are described in a system turn (appended to the first turn when it is a system
  message, else in a new system turn put first), each as one line of JSON: {"name",
  "description", "parameters"}, after a sentence saying how to call one.
* A call is written as
      <tool_call>
      {"name": "get_weather", "arguments": {"city": "Paris"}}
      </tool_call>
  several calls one after another; an assistant turn that made calls holds its text (if any)
  and then its calls in this form.
* A tool's result (a "tool" message) becomes a user turn
      <tool_response>
      {"tool_call_id": "call_...", "content": "..."}
      </tool_response>
  (the id ties it to the call, as OpenAI's tool_call_id does).

The grammar (tinygpt.server.structured) makes the reply follow the format when a call is
required, and holds a call the model begins under "auto" to it; parse_tool_calls reads it
back, and cut_tool_calls reads a reply that max_tokens cut in the middle of its calls. This
is the format Hermes-style and Qwen models are trained on; a model trained on another one
would take a template of its own instead.
"""

from __future__ import annotations

import json
import re
import uuid

from tinygpt.server.protocol import APIError

CALL_OPEN, CALL_CLOSE = "<tool_call>\n", "\n</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>\n", "\n</tool_response>"
INSTRUCTIONS = ("You can call functions. To call one, answer with <tool_call>, a newline, "
                "one line of JSON {\"name\": ..., \"arguments\": {...}}, a newline and "
                "</tool_call>, and nothing else; for several calls, write one after another. "
                "The functions, as JSON Schema:")


def tool_prompt(tools: list[dict]) -> str:
    """The system text that describes `tools` (OpenAI's [{"type": "function", "function":
    {...}}])."""
    lines = [INSTRUCTIONS]
    for tool in tools:
        function = tool["function"]
        lines.append(json.dumps({"name": function["name"],
                                 "description": function.get("description") or "",
                                 "parameters": function.get("parameters") or {}},
                                ensure_ascii=False))
    return "\n".join(lines)


def call_text(name: str, arguments: str | dict) -> str:
    """One call in the format: arguments as OpenAI sends them back (a JSON string) or parsed."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            raise APIError(400, f"tool_calls: the arguments of {name!r} are not JSON",
                           param="messages") from None
    call = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{CALL_OPEN}{call}{CALL_CLOSE}"


def with_tools(turns: list[dict], tools: list[dict] | None) -> list[dict]:
    """The conversation with the tools described in its system turn (a new first turn when
    it has none)."""
    if not tools:
        return turns
    text = tool_prompt(tools)
    if turns and turns[0]["role"] == "system":
        first = dict(turns[0], content=f"{turns[0]['content']}\n\n{text}")
        return [first, *turns[1:]]
    return [{"role": "system", "content": text}, *turns]


def assistant_text(content: str, tool_calls: list) -> str:
    """An assistant turn that made calls: its text, then each call in the format."""
    calls = []
    for i, call in enumerate(tool_calls):
        if not isinstance(call, dict) or not isinstance(call.get("function"), dict) \
                or not isinstance(call["function"].get("name"), str):
            raise APIError(400, f"tool_calls[{i}]: a call is {{\"id\", \"type\": \"function\", "
                                f"\"function\": {{\"name\", \"arguments\"}}}}",
                           param="messages")
        calls.append(call_text(call["function"]["name"], call["function"].get("arguments", "")))
    return "\n".join(([content] if content else []) + calls)


def tool_result_text(content: str, tool_call_id: str | None) -> str:
    """A "tool" message, as the user turn that carries it to the model."""
    body = json.dumps({"tool_call_id": tool_call_id, "content": content}, ensure_ascii=False)
    return f"{RESPONSE_OPEN}{body}{RESPONSE_CLOSE}"


def may_be_calls(text: str) -> bool:
    """Whether a reply that begins with `text` can still turn out to be calls (a streamed
    reply is held back only while this is true)."""
    text = text.lstrip()
    return text.startswith(CALL_OPEN) or CALL_OPEN.startswith(text)


def parse_tool_calls(text: str) -> list[dict] | None:
    """The calls in OpenAI's shape when the reply is calls in the format, one after another
    (whitespace around them aside) and nothing else; None otherwise: a reply that is text, or
    that only mentions <tool_call>, stays text."""
    rest, calls = text.strip(), []
    decoder = json.JSONDecoder()
    if not rest:
        return None
    while rest.strip():
        rest = rest.lstrip()
        if not rest.startswith(CALL_OPEN):
            return None
        try:
            call, end = decoder.raw_decode(rest, len(CALL_OPEN))
        except ValueError:
            return None
        if not (isinstance(call, dict) and set(call) == {"name", "arguments"}
                and isinstance(call["name"], str) and isinstance(call["arguments"], dict)):
            return None
        rest = rest[end:]
        if not rest.startswith(CALL_CLOSE):
            return None
        rest = rest[len(CALL_CLOSE):]
        calls.append(_call(call["name"], json.dumps(call["arguments"], ensure_ascii=False)))
    return calls


def _call(name: str, arguments: str) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


NAMED = re.compile(r'\{"name": "((?:[^"\\]|\\.)*)"')     # a call's name, written whole


def cut_tool_calls(text: str, name: str | None = None) -> list[dict]:
    """The calls of a reply that max_tokens cut while it was writing calls (the grammar's
    format: no whitespace inside a call's JSON but one space after ":" and ","), as OpenAI
    returns such a reply with finish_reason "length": every call begun, the last one with
    its arguments as far as they were written (a JSON string that may not parse; "" when
    they had not begun). A call whose name was not written whole is left out unless `name`
    says which function every call names (a named tool_choice, or a single tool). A JSON
    string cannot hold a raw newline, so CALL_CLOSE only ever ends a call."""
    *whole, last = text.lstrip().split(CALL_CLOSE)
    calls = (parse_tool_calls(CALL_CLOSE.join(whole) + CALL_CLOSE) or []) if whole else []
    last = last.lstrip()
    if not last:
        return calls
    body = last[len(CALL_OPEN):] if last.startswith(CALL_OPEN) else ""
    found = NAMED.match(body)
    if found is not None:
        name = json.loads(f'"{found.group(1)}"')
    if name is None:
        return calls
    rest = body[found.end():] if found is not None else ""
    head = ', "arguments":'
    written = rest[len(head):].lstrip(" ") if rest.startswith(head) else ""
    try:       # arguments written whole (the call's "}" or its closing tag was cut)
        arguments = json.dumps(json.JSONDecoder().raw_decode(written)[0], ensure_ascii=False)
    except ValueError:
        arguments = written
    return [*calls, _call(name, arguments)]
