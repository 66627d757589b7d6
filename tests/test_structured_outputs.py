"""Structured outputs and tool calls through the server (tinygpt.server.structured over
tinygpt.structured's llguidance grammars). In process on the shipped model, whose replies
are nonsense but must still parse: response_format json_object and json_schema, vLLM's
structured_outputs (json, regex, choice) on completions, tools with every tool_choice, calls
streamed as OpenAI streams them, a conversation that carries calls and their results, n > 1,
max_tokens too small ("length"), hostile schemas, a schema compiled once, grammars that
compile but cannot begin a reply (a 400 before any stream, refused from the cache the second
time), boolean schemas, and a json_schema beside another response_format type. Against a live
server on SmolLM2-135M-Instruct with the official openai client: `parse` with a pydantic
model, and tool calls whole and streamed."""

from __future__ import annotations

import json
import os
import re

import jsonschema
import pytest

from tests.test_server_api import Served
from tinygpt import load_pretrained

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "pets"],
          "properties": {"name": {"type": "string", "maxLength": 10},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "pets": {"type": "array", "maxItems": 2,
                                  "items": {"enum": ["cat", "dog", "fish"]}}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 12},
                                  "unit": {"enum": ["C", "F"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "additionalProperties": False,
                                       "required": ["zone"],
                                       "properties": {"zone": {"type": "string",
                                                               "maxLength": 8}}}}}
HI = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def real():
    model, tokenizer = load_pretrained()
    served = Served(model.eval(), tokenizer, max_waiting=64)
    yield served
    served.close()


def chat(real, **fields) -> dict:
    response = real.post("/v1/chat/completions", {"model": "tinygpt", "messages": HI,
                                                  "max_tokens": 120, "seed": 1, **fields})
    assert response.status_code == 200, response.text
    return response.json()


def events(real, path: str, body: dict) -> list[dict]:
    response = real.post(path, {**body, "stream": True})
    assert response.status_code == 200, response.text
    lines = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_json_schema_replies_parse_and_end_by_themselves(real):
    # (json_object is checked on SmolLM2 below: the shipped model, trained on stories, would
    # write one endless string inside {"...; a bounded schema ends whatever the model does)
    for seed in range(3):
        reply = chat(real, seed=seed, temperature=1.0, response_format={
            "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                   "strict": True}})["choices"][0]
        value = json.loads(reply["message"]["content"])
        jsonschema.validate(value, PERSON)
        assert list(value) == ["name", "age", "pets"]             # in the schema's order
        assert reply["finish_reason"] == "stop"


def test_a_streamed_schema_reply_equals_the_whole_one(real):
    fields = {"response_format": {"type": "json_schema", "json_schema": {
        "name": "person", "schema": PERSON}}, "temperature": 0.8, "seed": 5}
    whole = chat(real, **fields)["choices"][0]["message"]["content"]
    chunks = events(real, "/v1/chat/completions", {"model": "tinygpt", "messages": HI,
                                                   "max_tokens": 120, **fields})
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                       if c["choices"])
    assert streamed == whole
    jsonschema.validate(json.loads(streamed), PERSON)


def test_structured_outputs_on_completions(real):
    def complete(**fields) -> dict:
        response = real.post("/v1/completions", {"model": "tinygpt", "prompt": "the cat",
                                                 "max_tokens": 40, "seed": 2, **fields})
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]

    got = complete(structured_outputs={"regex": r"[0-9]{3}-[a-z]{2,4}"})
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", got["text"]) and got["finish_reason"] == "stop"
    got = complete(structured_outputs={"choice": ["yes", "no", "maybe not"]}, temperature=1.0)
    assert got["text"] in ("yes", "no", "maybe not")
    got = complete(structured_outputs={"json": PERSON}, max_tokens=120)
    jsonschema.validate(json.loads(got["text"]), PERSON)
    got = complete(structured_outputs={"json_object": True}, max_tokens=6)
    assert got["text"].startswith("{")                          # (cut: see above)


def test_n_choices_each_follow_the_schema(real):
    body = chat(real, n=3, temperature=1.0, response_format={
        "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    texts = [c["message"]["content"] for c in body["choices"]]
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)
    assert len(set(texts)) > 1                                   # each its own grammar state


def test_a_reply_cut_by_max_tokens_ends_with_length(real):
    reply = chat(real, max_tokens=3, response_format={
        "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    assert reply["choices"][0]["finish_reason"] == "length"


def check_call(call: dict, tools: list[dict]) -> dict:
    assert re.fullmatch(r"call_[0-9a-f]{24}", call["id"]) and call["type"] == "function"
    (tool,) = [t for t in tools if t["function"]["name"] == call["function"]["name"]]
    arguments = json.loads(call["function"]["arguments"])
    jsonschema.validate(arguments, tool["function"]["parameters"])
    return arguments


def test_tool_choice_required_and_named_give_valid_calls(real):
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        for parallel in (True, False):
            reply = chat(real, tools=[WEATHER, TIME], tool_choice=choice, temperature=1.0,
                         parallel_tool_calls=parallel)["choices"][0]
            message = reply["message"]
            assert message["content"] is None and reply["finish_reason"] == "tool_calls"
            assert message["tool_calls"] and (parallel or len(message["tool_calls"]) == 1)
            for call in message["tool_calls"]:
                check_call(call, [WEATHER, TIME])
                if isinstance(choice, dict):
                    assert call["function"]["name"] == "get_time"


def test_streamed_tool_calls_rebuild_the_whole_reply(real):
    fields = {"tools": [WEATHER, TIME], "tool_choice": "required", "temperature": 0.7,
              "seed": 9, "parallel_tool_calls": False}
    whole = chat(real, **fields)["choices"][0]["message"]["tool_calls"]
    chunks = events(real, "/v1/chat/completions", {"model": "tinygpt", "messages": HI,
                                                   "max_tokens": 120, **fields})
    calls: dict[int, dict] = {}
    for chunk in chunks:
        delta = chunk["choices"][0]["delta"] if chunk["choices"] else {}
        assert not delta.get("content")                         # calls are not content
        for part in delta.get("tool_calls", ()):
            call = calls.setdefault(part["index"], {"function": {"arguments": ""}})
            if "id" in part:                                    # id and name come first
                assert "name" not in call["function"]
                call.update(id=part["id"], type=part["type"])
                call["function"]["name"] = part["function"]["name"]
            call["function"]["arguments"] += part["function"]["arguments"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert [c["function"] for c in calls.values()] == [c["function"] for c in whole]


def test_a_conversation_with_calls_and_results_is_rendered(real, monkeypatch):
    history = [*HI, {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"}]
    response = real.post("/tokenize", {"model": "tinygpt", "messages": history,
                                       "return_token_strs": True})
    reply = real.post("/v1/chat/completions", {"model": "tinygpt", "messages": history,
                                               "tools": [WEATHER], "max_tokens": 5})
    assert response.status_code == 200 and reply.status_code == 200, reply.text
    text = "".join(response.json()["token_strs"])
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' \
        in text
    assert '<tool_response>\n{"tool_call_id": "call_1", "content": "18 C and sunny"}' in text


def test_hostile_schemas_are_bounded(real):
    for depth, param in ((300, "response_format.json_schema.schema"),    # our limit, 200
                         (5000, None)):                           # the JSON parser's own
        deep = '{"type": "array", "items": ' * depth + '{"type": "integer"}' + "}" * depth
        body = ('{"model": "tinygpt", "messages": [{"role": "user", "content": "hi"}], '
                '"response_format": {"type": "json_schema", "json_schema": {"name": "deep", '
                f'"schema": {deep}}}}}}}')
        response = real.post("/v1/chat/completions", body.encode())
        assert response.status_code == 400, (depth, response.text[:300])
        assert response.json()["error"]["param"] == param, response.text[:300]
    many = {"enum": [f"value{i}" for i in range(10_000)]}
    reply = chat(real, max_tokens=12, response_format={
        "type": "json_schema", "json_schema": {"name": "many", "schema": many}})["choices"][0]
    assert reply["finish_reason"] == "stop", reply
    assert json.loads(reply["message"]["content"]) in many["enum"]


def test_a_schema_is_compiled_once(real):
    grammars = real.app.state.served.prompts.grammars
    schema = {"type": "object", "properties": {"k": {"const": os.urandom(4).hex()}},
              "required": ["k"]}
    fields = {"response_format": {"type": "json_schema", "json_schema": {"name": "once",
                                                                         "schema": schema}}}
    before = grammars.compiled
    chat(real, **fields)
    assert grammars.compiled == before + 1            # compiled here, by the served Grammars
    chat(real, **fields, seed=2)
    assert grammars.compiled == before + 1            # and not again


CYCLE = {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
# grammars that compile but that the engine cannot begin a reply with: a regex whose first
# token runs the lexer out of fuel, a rule with no end, a $ref cycle (no text matches either)
UNSTARTABLE = [({"structured_outputs": {"regex": "a{1000000}"}}, "structured_outputs.regex"),
               ({"structured_outputs": {"grammar": "start: start"}},
                "structured_outputs.grammar"),
               ({"structured_outputs": {"json": CYCLE}}, "structured_outputs.json"),
               ({"response_format": {"type": "json_schema", "json_schema": {
                   "name": "cycle", "schema": CYCLE}}}, "response_format.json_schema.schema")]


def refused(real, path: str, body: dict, param: str) -> str:
    """The message of the 400 a request gets, checked whole: JSON, never a stream begun."""
    response = real.post(path, {"model": "tinygpt", "max_tokens": 5, **body})
    assert response.status_code == 400, (body, response.text[:300])
    assert response.headers["content-type"].startswith("application/json"), body
    error = response.json()["error"]
    assert error["param"] == param, (body, error)
    return error["message"]


def test_a_grammar_the_engine_cannot_begin_is_a_short_400_before_any_stream(real):
    for fields, param in UNSTARTABLE:
        for path, prompt in (("/v1/chat/completions", {"messages": HI}),
                             ("/v1/completions", {"prompt": "Hello"})):
            for stream in (False, True):
                message = refused(real, path, {**prompt, **fields, "stream": stream}, param)
                assert len(message) < 300 and "\n" not in message, message
                assert "cannot begin a reply" in message and "<state>" not in message


def test_a_grammar_that_cannot_begin_is_refused_from_the_cache_the_second_time(real):
    grammars = real.app.state.served.prompts.grammars
    pattern = f"a{{{1_000_000 + int.from_bytes(os.urandom(2), 'big')}}}"   # new each run
    body = {"prompt": "Hello", "structured_outputs": {"regex": pattern}}
    before = grammars.compiled
    first = refused(real, "/v1/completions", body, "structured_outputs.regex")
    assert "cannot begin a reply" in first and grammars.compiled == before + 1
    assert refused(real, "/v1/completions", body, "structured_outputs.regex") == first
    assert grammars.compiled == before + 1            # refused again without a compile


def test_boolean_schemas_true_is_any_value_and_false_is_a_400(real):
    for seed in range(3):
        replies = [chat(real, seed=seed, temperature=1.0, max_tokens=40, response_format={
            "type": "json_schema", "json_schema": {"name": "any", "schema": schema}}
        )["choices"][0]["message"]["content"] for schema in (True, {})]
        assert replies[0] == replies[1]                    # true is {}: the same grammar
        completions = [real.post("/v1/completions", {
            "model": "tinygpt", "prompt": "the cat", "max_tokens": 40, "seed": seed,
            "temperature": 1.0, "structured_outputs": {"json": schema}})
            for schema in (True, "true", {})]
        assert [r.status_code for r in completions] == [200] * 3, completions[0].text[:300]
        assert len({r.json()["choices"][0]["text"] for r in completions}) == 1
    for path, body, param in [
            ("/v1/completions", {"prompt": "x", "structured_outputs": {"json": False}},
             "structured_outputs.json"),
            ("/v1/completions", {"prompt": "x", "structured_outputs": {"json": "false"}},
             "structured_outputs.json"),
            ("/v1/chat/completions", {"messages": HI, "response_format": {
                "type": "json_schema", "json_schema": {"name": "none", "schema": False}}},
             "response_format.json_schema.schema")]:
        assert "false admits no value" in refused(real, path, body, param)


def test_a_json_schema_beside_another_response_format_type_is_a_400(real):
    spec = {"name": "person", "schema": PERSON}
    for kind in ("text", "json_object"):
        message = refused(real, "/v1/chat/completions", {"messages": HI, "response_format": {
            "type": kind, "json_schema": spec}}, "response_format.json_schema")
        assert "only allowed with type 'json_schema'" in message and repr(kind) in message


def test_ignore_eos_with_a_grammar_is_a_400_naming_both(real):
    """A grammar ends its reply on the end-of-text token; ignore_eos took that away and the
    answer was the constraint's "eos_ids: a constrained request needs an end-of-text id to
    end on" with no field. Without ignore_eos the same requests are answered."""
    for path, body, field in (
            ("/v1/chat/completions", {"messages": HI, "response_format": {
                "type": "json_object"}}, "response_format"),
            ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "(yes|no)"}},
             "structured_outputs"),
            ("/v1/chat/completions", {"messages": HI, "tools": [WEATHER],
                                      "tool_choice": "required"}, "tools"),
            ("/v1/chat/completions", {"messages": HI, "tools": [WEATHER], "tool_choice": {
                "type": "function", "function": {"name": "get_weather"}}}, "tool_choice")):
        body = {"model": "tinygpt", "max_tokens": 8, "temperature": 0, **body}
        message = refused(real, path, {**body, "ignore_eos": True}, "ignore_eos")
        assert f"give one of ignore_eos and {field}" in message, message
        assert real.post(path, {**body, "ignore_eos": False}).status_code == 200
    plain = real.post("/v1/chat/completions", {"model": "tinygpt", "messages": HI,
                                               "max_tokens": 4, "ignore_eos": True})
    assert plain.status_code == 200, plain.text


# -- a live server on SmolLM2-135M-Instruct, with the official openai client ------------------

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def smollm2():
    from tinygpt.bench.load import running_server

    with running_server("--model", "smollm2", "--threads", "1",
                        env=dict(os.environ, OMP_NUM_THREADS="1")) as (url, _):
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="not-needed", max_retries=0,
                            timeout=120)


@pytest.mark.slow
def test_the_openai_clients_parse_gets_a_valid_pydantic_object(smollm2):
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=20)
        country: str = Field(max_length=20)
        population_millions: int = Field(ge=0, le=50)

    model = smollm2.models.list().data[0].id
    completion = smollm2.chat.completions.parse(
        model=model, messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format=City, max_tokens=100, temperature=0)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, City)
    reply = smollm2.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Give me a JSON object."}],
        response_format={"type": "json_object"}, max_tokens=80, temperature=0)
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    assert reply.choices[0].finish_reason == "stop"


@pytest.mark.slow
def test_the_openai_client_reads_tool_calls_whole_and_streamed(smollm2):
    model = smollm2.models.list().data[0].id
    fields = {"model": model, "messages": HI, "tools": [WEATHER, TIME], "max_tokens": 60,
              "tool_choice": "required", "temperature": 0, "parallel_tool_calls": False}
    whole = smollm2.chat.completions.create(**fields)
    (call,) = whole.choices[0].message.tool_calls[:1]
    assert whole.choices[0].finish_reason == "tool_calls"
    check_call(call.model_dump(), [WEATHER, TIME])
    names, arguments, finish = {}, {}, None
    for chunk in smollm2.chat.completions.create(**fields, stream=True):
        for part in chunk.choices[0].delta.tool_calls or ():
            if part.function.name:
                names[part.index] = part.function.name
            arguments[part.index] = arguments.get(part.index, "") + (
                part.function.arguments or "")
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [(names[i], arguments[i]) for i in sorted(names)] == [
        (c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls]


def test_without_a_grammar_engine_structured_requests_are_a_400_saying_why(monkeypatch):
    import tinygpt.server.app as app_module

    def unreadable(*_args, **_kwargs):
        raise ValueError("can't determine decoder type")

    monkeypatch.setattr(app_module, "Grammars", unreadable)
    model, tokenizer = load_pretrained()
    served = Served(model.eval(), tokenizer, max_waiting=4)
    try:
        response = served.post("/v1/chat/completions", {
            "model": "tinygpt", "messages": HI, "response_format": {"type": "json_object"}})
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["param"] == "response_format" and "decoder type" in error["message"]
        plain = served.post("/v1/chat/completions", {"model": "tinygpt", "messages": HI,
                                                     "max_tokens": 2})
        assert plain.status_code == 200                 # everything else is served
        auto = served.post("/v1/chat/completions", {"model": "tinygpt", "messages": HI,
                                                    "max_tokens": 2, "tools": [WEATHER]})
        assert auto.status_code == 200                  # "auto" tools need no grammar
        required = served.post("/v1/chat/completions", {
            "model": "tinygpt", "messages": HI, "tools": [WEATHER], "tool_choice": "required"})
        assert required.status_code == 400 and required.json()["error"]["param"] == "tools"
    finally:
        served.close()


def test_pydantic_style_schemas_refs_into_defs_and_open_objects(real):
    """What pydantic writes: "$ref" into "$defs" (an Enum), and objects without
    additionalProperties, which the server closes (vLLM's default) so no key is invented."""
    place = {"type": "object", "required": ["city", "size"],
             "properties": {"city": {"type": "string", "maxLength": 8},
                            "size": {"$ref": "#/$defs/Size"}},
             "$defs": {"Size": {"enum": ["small", "large"], "type": "string"}}}
    tool = {"type": "function", "function": {"name": "final_result", "parameters": place}}
    other = {"type": "function", "function": {"name": "other", "parameters": {
        "type": "object", "properties": {"size": {"$ref": "#/$defs/Size"}},
        "$defs": {"Size": {"const": "tiny"}}}}}       # the same $defs name, another meaning
    for seed in range(3):
        reply = chat(real, tools=[tool, other], tool_choice="required", seed=seed,
                     temperature=1.0, parallel_tool_calls=False)["choices"][0]
        (call,) = reply["message"]["tool_calls"]
        arguments = json.loads(call["function"]["arguments"])
        if call["function"]["name"] == "final_result":
            jsonschema.validate(arguments, place)
            assert set(arguments) == {"city", "size"}
        else:
            assert arguments in ({}, {"size": "tiny"})
        content = chat(real, seed=seed, temperature=1.0, response_format={
            "type": "json_schema", "json_schema": {"name": "place", "schema": place}}
        )["choices"][0]["message"]["content"]
        assert set(json.loads(content)) == {"city", "size"}


def test_hostile_requests_beside_a_stream_leave_it_whole(real):
    """Refusing hostile schemas (and compiling a big enum) happens beside a running stream,
    which still ends with every token: a request that asks too much never takes the server."""
    import asyncio

    deep = '{"type": "array", "items": ' * 300 + '{"type": "integer"}' + "}" * 300
    hostile = [
        ('{"model": "tinygpt", "messages": [{"role": "user", "content": "hi"}], '
         '"response_format": {"type": "json_schema", "json_schema": {"name": "d", "schema": '
         f'{deep}}}}}}}'),
        json.dumps({"model": "tinygpt", "messages": HI, "max_tokens": 4, "response_format": {
            "type": "json_schema", "json_schema": {"name": "e", "schema": {
                "enum": [f"v{i}" for i in range(10_000)]}}}}),
        json.dumps({"model": "tinygpt", "prompt": "x", "structured_outputs": {
            "regex": "(a+)+$" * 50}}),
        json.dumps({"model": "tinygpt", "prompt": "x", "structured_outputs": {
            "grammar": "start: " + " | ".join(f'"{i}"' for i in range(5000))}})]
    stream = json.dumps({"model": "tinygpt", "prompt": "the cat", "max_tokens": 60,
                         "ignore_eos": True, "stream": True, "temperature": 0})
    headers = {"content-type": "application/json"}

    async def together():
        return await asyncio.gather(
            real.client.post("/v1/completions", content=stream, headers=headers),
            *(real.client.post("/v1/chat/completions" if "messages" in body else
                               "/v1/completions", content=body, headers=headers)
              for body in hostile))

    streamed, *answers = real.loop.run_until_complete(together())
    assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")
    chunks = [json.loads(line[6:]) for line in streamed.text.splitlines()
              if line.startswith("data: {")]
    assert sum(1 for c in chunks if c["choices"] and c["choices"][0]["text"] is not None) >= 60
    assert [a.status_code < 500 for a in answers] == [True] * len(answers), \
        [a.text[:200] for a in answers]
    assert answers[0].status_code == 400
