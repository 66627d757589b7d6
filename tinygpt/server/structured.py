"""What a request asks its reply to look like, as a grammar (tinygpt.structured): OpenAI's
response_format ({"type": "json_object"} or {"type": "json_schema", "json_schema": {"name",
"schema", "strict"}}), tools with tool_choice (chat), and vLLM's structured_outputs (json,
regex, choice, grammar, json_object) on both endpoints. Each problem is a 400 naming the field:
an unknown type, a json_schema beside a type that would not use it, a schema that is not JSON
Schema (or is false, which admits no value; true is {}), a pattern that is not a regex, a
grammar past the limits or that the engine cannot begin a reply with (the compile takes its
first step: tinygpt.structured), a named tool_choice whose type is not "function", two ways
of constraining one reply. The message is short: the engine's first line, at most 300
characters in all.

Tool calls follow tinygpt.server.tools' format. tool_choice "required" constrains the reply to
one or more calls of the listed functions (one only with parallel_tool_calls false), a named
function to one call of it; "none" leaves the tools out of the prompt. "auto" lets the model
answer in text OR in calls, and holds a call it starts to the tools' schemas, as vLLM and
SGLang do when they can: its grammar is

    start: calls | TEXT
    TEXT:  any text that does not begin (after whitespace) with "<tool_call>"

with `calls` the "required" grammar (each call's JSON a %json of the tools' call schema). One
grammar, not a trigger that switches constraints once the tag shows up: the tag can be split
over tokens in many ways (SmolLM2 writes "<tool_call>" as 4 tokens, and several of them also
begin ordinary text), and the grammar engine already masks by bytes, so whatever
tokenization the model picks, once its reply has begun with the tag it can only go on as a
valid call. What the grammar does not constrain: text, and a tag the model writes after some
text (the reply is then text, as parse_tool_calls reads it). Without a grammar engine (a
tensor-parallel server) "auto" stays free, read for calls afterwards.

A reply held to calls ("required", a named function, or "auto" once it began with the tag)
that max_tokens cuts comes back as OpenAI's does: finish_reason "length" and the calls begun,
the last with the arguments written so far (tinygpt.server.tools.cut_tool_calls), never as
text; one that a stop string cuts, the same with finish_reason "stop"."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from tinygpt.server.protocol import APIError
from tinygpt.server.tools import CALL_CLOSE, CALL_OPEN
from tinygpt.structured import JSON_STYLE, Grammar, GrammarError, Grammars

NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")      # OpenAI's rule for json_schema and tool names


@dataclass
class Shape:
    """A request's reply shape: the grammar it is held to (None: free text) and how the
    reply is read: "text", or "tools" (calls are parsed out of it)."""

    grammar: Grammar | None
    reads: str = "text"              # "tools": text or calls ("auto"); "calls": calls only
    tools: list | None = None        # the tools described in the prompt (None: none)
    call_name: str | None = None     # the function every call names, when only one can be
    param: str | None = None         # the field that asked for the grammar (errors name it)


def _compile(what: str, param: str, build) -> Grammar:
    try:
        return build()
    except GrammarError as err:      # (the engine's first line; the compile took its first step)
        raise APIError(400, f"{param}: {what}: {err}"[:300], param=param) from None


MAX_DEPTH = 200       # levels of nesting in a schema or tool parameters (the engine's own
                      # recursion limit refuses deeper grammars anyway, at about 60 levels)


def check_depth(value, param: str) -> None:
    """APIError 400 when `value` nests deeper than MAX_DEPTH (counted without recursion, so a
    hostile schema cannot exhaust Python's stack here)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise APIError(400, f"{param}: nested more than {MAX_DEPTH} levels deep",
                           param=param)
        children = item.values() if isinstance(item, dict) else item if isinstance(
            item, list) else ()
        stack.extend((child, depth + 1) for child in children
                     if isinstance(child, dict | list))


def _schema_grammar(grammars: Grammars, schema, param: str) -> Grammar:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            raise APIError(400, f"{param}: the schema is not JSON", param=param) from None
    if not isinstance(schema, dict | bool):
        raise APIError(400, f"{param}: a JSON Schema is an object (or true / false)",
                       param=param)
    if schema is False:
        raise APIError(400, f"{param}: the schema false admits no value, so no reply can be "
                            f"written; give true or {{}} for any JSON value, or an object "
                            f"schema", param=param)
    if schema is True:               # any JSON value, as {} is (the engine takes only objects)
        schema = {}
    check_depth(schema, param)
    return _compile("the schema cannot be used", param,
                    lambda: grammars.json_schema(closed(schema)))


def check_response_format(fmt) -> None:
    """APIError 400 for a response_format that cannot be read as it was meant: an unknown
    type, or a json_schema beside a type that would leave it unused."""
    if fmt is None:
        return
    if fmt.type not in ("text", "json_object", "json_schema"):
        raise APIError(400, f"response_format.type must be one of ['text', 'json_object', "
                            f"'json_schema'], got {fmt.type!r}"[:300], param="response_format")
    if fmt.json_schema is not None and fmt.type != "json_schema":
        raise APIError(400, f"response_format.json_schema is only allowed with type "
                            f"'json_schema', got type {fmt.type!r}",
                       param="response_format.json_schema")


def response_format_grammar(grammars: Grammars, fmt) -> Grammar | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return grammars.json_object()
    spec = fmt.json_schema           # (type json_schema: check_response_format read the rest)
    if spec is None:
        raise APIError(400, "response_format: type json_schema needs json_schema: {\"name\", "
                            "\"schema\"}", param="response_format")
    if not NAME.match(spec.name):
        raise APIError(400, f"response_format.json_schema.name must match {NAME.pattern}, "
                            f"got {spec.name!r}"[:300], param="response_format")
    return _schema_grammar(grammars, {} if spec.schema_ is None else spec.schema_,
                           "response_format.json_schema.schema")


def structured_outputs_grammar(grammars: Grammars, spec) -> Grammar | None:
    if spec is None:
        return None
    given = [name for name in ("json_", "regex", "choice", "grammar", "json_object")
             if getattr(spec, name) is not None and (name != "json_object" or spec.json_object)]
    if len(given) != 1:
        raise APIError(400, "structured_outputs: give exactly one of json, regex, choice, "
                            "grammar and json_object", param="structured_outputs")
    kind = given[0]
    param = f"structured_outputs.{kind.rstrip('_')}"
    if kind == "json_":
        return _schema_grammar(grammars, spec.json_, param)
    if kind == "json_object":
        return grammars.json_object()
    if kind == "regex":
        return _compile("not a regex the engine takes", param, lambda: grammars.regex(spec.regex))
    if kind == "choice":
        return _compile("choice", param, lambda: grammars.choice(spec.choice))
    return _compile("the grammar cannot be used", param, lambda: grammars.lark(spec.grammar))


# keywords whose values are JSON data, not schemas: the walkers below leave them as they are
DATA_KEYWORDS = ("const", "enum", "default", "examples")


def closed(schema):
    """`schema` with every object that lists its properties closed to others (an object
    schema with "properties" and no "additionalProperties", "patternProperties" or
    "unevaluatedProperties" gets additionalProperties: false), as vLLM's grammars close them
    by default: JSON Schema would let a model add keys forever, and a small one does. Objects
    that list no properties ({"type": "object"}) stay open."""
    if isinstance(schema, list):
        return [closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: value if key in DATA_KEYWORDS else closed(value)
           for key, value in schema.items()}
    if "properties" in out and not {"additionalProperties", "patternProperties",
                                    "unevaluatedProperties"} & set(out):
        out["additionalProperties"] = False
    return out


def _rebase(value, base: str):
    """value with each local "$ref" ("#", "#/...") pointing under `base` instead."""
    if isinstance(value, list):
        return [_rebase(item, base) for item in value]
    if not isinstance(value, dict):
        return value
    out = {}
    for key, item in value.items():
        if key == "$ref" and isinstance(item, str) and (item == "#" or item.startswith("#/")):
            out[key] = base + item[1:]
        elif key in DATA_KEYWORDS:
            out[key] = item
        else:
            out[key] = _rebase(item, base)
    return out


def call_schema(tools: list) -> dict:
    """The JSON of one call of any of `tools`: {"name": its name, "arguments": its
    parameters}. Each tool's parameters sit in $defs under the tool's name, their own
    references ("#/$defs/...", "#") rebased there, so that pydantic's $defs still resolve and
    two tools' definitions never collide."""
    defs, calls = {}, []
    for tool in tools:
        parameters = tool.function.parameters or {"type": "object"}
        defs[tool.function.name] = _rebase(closed(parameters), f"#/$defs/{tool.function.name}")
        calls.append({"type": "object", "additionalProperties": False,
                      "required": ["name", "arguments"],
                      "properties": {"name": {"const": tool.function.name},
                                     "arguments": {"$ref": f"#/$defs/{tool.function.name}"}}})
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return {**schema, "$defs": defs}


# text that does not begin, after whitespace, with the opening tag (lark's & and ~ on regexes)
FREE_TEXT = (f"/(?s:.*)/ & ~/[ \\t\\r\\n]*{re.escape(CALL_OPEN.strip())}(?s:.*)/")


def tool_grammar(grammars: Grammars, tools: list, many: bool, text: bool = False) -> Grammar:
    """Replies that are calls in tinygpt.server.tools' format: one, or one or more; with
    text=True ("auto"), or else any text that does not begin with a call."""
    schema = call_schema(tools)
    schema["x-guidance"] = JSON_STYLE           # the same JSON style as response_format's
    call = (f"call: {json.dumps(CALL_OPEN)} %json {json.dumps(schema)} "
            f"{json.dumps(CALL_CLOSE)}")
    calls = 'calls: call ("\\n" call)*' if many else "calls: call"
    start = "start: calls | TEXT\nTEXT: " + FREE_TEXT if text else "start: calls"
    return _compile("the tools' parameters cannot be used", "tools",
                    lambda: grammars.lark(f"{start}\n{calls}\n{call}\n"))


def check_tools(tools: list) -> None:
    names = set()
    for i, tool in enumerate(tools):
        check_depth(tool.function.parameters, "tools")
        if tool.type != "function":
            raise APIError(400, f"tools[{i}].type must be 'function', got {tool.type!r}"[:300],
                           param="tools")
        if not NAME.match(tool.function.name):
            raise APIError(400, f"tools[{i}].function.name must match {NAME.pattern}, got "
                                f"{tool.function.name!r}"[:300], param="tools")
        if tool.function.name in names:
            raise APIError(400, f"tools[{i}]: a second function named "
                                f"{tool.function.name!r}", param="tools")
        names.add(tool.function.name)


def reply_shape(grammars: Grammars | str, body, chat: bool) -> Shape:
    """The shape of the reply a request asks for (APIError 400 for what cannot be served);
    grammars: the served model's, or why there are none."""
    tools = body.tools if chat else None
    choice = body.tool_choice if chat else None
    check_response_format(body.response_format)
    asked = [name for name, value in (("response_format", response_format_active(body)),
                                      ("structured_outputs", body.structured_outputs),
                                      ("tools", tools and choice != "none")) if value]
    if len(asked) > 1:
        raise APIError(400, f"{' and '.join(asked)}: one reply can be constrained one way; "
                            f"give one of them", param=asked[1])
    needs = [name for name in asked if name != "tools" or choice not in (None, "auto")]
    if needs and isinstance(grammars, str):      # ("auto" tools can do without a grammar)
        raise APIError(400, f"{needs[0]}: structured outputs are not available here: "
                            f"{grammars}"[:500], param=needs[0])
    if tools:
        check_tools(tools)
    if chat and choice is not None and not tools and choice != "none":
        raise APIError(400, "tool_choice: without tools, only 'none' is possible",
                       param="tool_choice")
    if not tools or choice == "none":
        if not asked:
            return Shape(None)
        return Shape(response_format_grammar(grammars, body.response_format)
                     or structured_outputs_grammar(grammars, body.structured_outputs),
                     param=asked[0])
    many = body.parallel_tool_calls is not False
    only = tools[0].function.name if len(tools) == 1 else None
    if choice is None or choice == "auto":
        if isinstance(grammars, str):            # no grammar engine: the reply stays free
            return Shape(None, "tools", tools)
        return Shape(tool_grammar(grammars, tools, many, text=True), "tools", tools, only,
                     "tools")
    if choice == "required":
        return Shape(tool_grammar(grammars, tools, many), "calls", tools, only, "tools")
    if isinstance(choice, str):
        raise APIError(400, f"tool_choice must be 'none', 'auto', 'required' or {{\"type\": "
                            f"\"function\", \"function\": {{\"name\"}}}}, got {choice!r}"[:300],
                       param="tool_choice")
    if choice.type != "function":
        raise APIError(400, f"tool_choice.type must be 'function', got {choice.type!r}"[:300],
                       param="tool_choice.type")
    named = [tool for tool in tools if tool.function.name == choice.function.name]
    if not named:
        raise APIError(400, f"tool_choice names {choice.function.name!r}, which is not among "
                            f"the tools"[:300], param="tool_choice")
    return Shape(tool_grammar(grammars, named, many=False), "calls", tools,
                 named[0].function.name, "tool_choice")


def response_format_active(body) -> bool:
    fmt = body.response_format
    return fmt is not None and fmt.type != "text"
