"""tool_choice "auto" held to the tools' schemas once the model begins a call, and a reply held
to calls that max_tokens cuts: finish_reason "length" with the calls begun (the last one's
arguments as far as they were written), never a text message (a stop string's cut likewise,
with finish_reason "stop"); whole, streamed, and read by
the official openai client, in process on the shipped model. The oracle for a cut reply is
the same greedy request with room to finish: the cut arguments are a prefix of its. A named
tool_choice of a type other than "function" is a 400 naming tool_choice.type."""

from __future__ import annotations

import pytest

from tests.test_structured_outputs import HI, TIME, WEATHER, chat, events
from tests.test_structured_outputs import real as real  # noqa: F401 (the served fixture)
from tinygpt.server.protocol import ChatCompletionRequest
from tinygpt.server.structured import reply_shape
from tinygpt.server.tools import CALL_CLOSE, CALL_OPEN
from tinygpt.structured import GrammarError

CALL = f'{CALL_OPEN}{{"name": "get_weather", "arguments": {{"city": "Paris"}}}}{CALL_CLOSE}'


def auto_constraint(real, tools, parallel=True):
    served = real.app.state.served
    body = ChatCompletionRequest.model_validate({
        "model": "tinygpt", "messages": HI, "tools": tools, "tool_choice": "auto",
        "parallel_tool_calls": parallel})
    shape = reply_shape(served.prompts.grammars, body, True)
    assert shape.reads == "tools" and shape.grammar is not None      # constrained now
    eos = served.prompts.end_of_turn
    return shape.grammar.constraint(eos), eos, served.prompts.tokenizer


def feed(constraint, tokenizer, text: str) -> bool:
    """Whether the grammar takes `text` (as the tokenizer writes it), token by token."""
    try:
        for token in tokenizer.encode(text):
            if not constraint.allowed()[token]:
                return False
            constraint.advance(token)
    except GrammarError:
        return False
    return True


def test_auto_lets_text_through_and_holds_a_begun_call_to_the_schemas(real):
    for text, ok, ends in [
            ("It is sunny in Paris. <tool_call> is how I would call it.", True, True),
            ("", True, True),
            (CALL, True, True),
            (f"{CALL}\n{CALL}", True, True),
            (CALL[:40], True, False),                          # a call begun: not an end yet
            (f'{CALL_OPEN}{{"name": "get_time", "arguments": {{}}}}{CALL_CLOSE}', False, None),
            (f'{CALL_OPEN}{{"name": "get_weather", "arguments": {{"town": "Paris"}}}}',
             False, None),
            (f"{CALL_OPEN}I would rather write text", False, None),
            (f"  {CALL}", False, None)]:                       # a call begins at the start
        constraint, eos, tokenizer = auto_constraint(real, [WEATHER])
        assert feed(constraint, tokenizer, text) == ok, text
        if ok:
            assert bool(constraint.allowed()[eos].all()) == ends, text
    constraint, _, tokenizer = auto_constraint(real, [WEATHER], parallel=False)
    assert not feed(constraint, tokenizer, f"{CALL}\n{CALL}")   # one call only
    constraint, _, tokenizer = auto_constraint(real, [WEATHER, TIME])
    assert feed(constraint, tokenizer, CALL_OPEN)
    forced = tokenizer.decode(constraint.forced())
    assert forced.startswith('{"name": "get_')                 # the call's JSON, forced


def test_auto_answers_text_that_stays_text(real):
    reply = chat(real, tools=[WEATHER], tool_choice="auto", max_tokens=20)["choices"][0]
    assert isinstance(reply["message"]["content"], str) and "tool_calls" not in reply["message"]
    assert reply["finish_reason"] in ("stop", "length")


def test_a_required_call_cut_by_max_tokens_is_a_partial_call_not_text(real):
    fields = {"tools": [WEATHER], "tool_choice": "required", "temperature": 0}
    whole = chat(real, **fields)["choices"][0]
    assert whole["finish_reason"] == "tool_calls"
    (call,) = whole["message"]["tool_calls"]
    arguments = call["function"]["arguments"]
    seen = set()
    for max_tokens in (1, 8, 20, 44, 50, 56, 62):      # (the call takes about 69 tokens)
        reply = chat(real, **fields, max_tokens=max_tokens)["choices"][0]
        if reply["finish_reason"] == "tool_calls":               # it fitted
            continue
        assert reply["finish_reason"] == "length", max_tokens
        message = reply["message"]
        assert message["content"] is None, (max_tokens, message)
        (cut,) = message["tool_calls"]                          # one tool: its name is known
        assert cut["function"]["name"] == "get_weather" and cut["id"].startswith("call_")
        assert arguments.startswith(cut["function"]["arguments"]), (max_tokens, cut)
        seen.add(cut["function"]["arguments"])
    assert "" in seen and len(seen) >= 3                    # cut before and inside arguments


def test_a_cut_call_streams_as_it_comes_back_whole(real):
    fields = {"tools": [WEATHER, TIME], "tool_choice": {"type": "function", "function": {
        "name": "get_time"}}, "temperature": 0, "max_tokens": 14}
    whole = chat(real, **fields)["choices"][0]
    assert whole["finish_reason"] == "length" and whole["message"]["content"] is None
    chunks = events(real, "/v1/chat/completions", {"model": "tinygpt", "messages": HI,
                                                   **fields})
    calls: dict[int, dict] = {}
    for chunk in chunks:
        delta = chunk["choices"][0]["delta"] if chunk["choices"] else {}
        assert not delta.get("content")
        for part in delta.get("tool_calls", ()):
            call = calls.setdefault(part["index"], {"name": None, "arguments": ""})
            if "id" in part:
                call["name"] = part["function"]["name"]
            call["arguments"] += part["function"]["arguments"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert list(calls.values()) == [{"name": c["function"]["name"],
                                     "arguments": c["function"]["arguments"]}
                                    for c in whole["message"]["tool_calls"]]
    assert list(calls.values())[0]["name"] == "get_time"


def streamed_calls(chunks: list[dict]) -> list[dict]:
    """The calls a stream sent, as {"name", "arguments"}; no chunk may carry content."""
    calls: dict[int, dict] = {}
    for chunk in chunks:
        delta = chunk["choices"][0]["delta"] if chunk["choices"] else {}
        assert not delta.get("content"), delta
        for part in delta.get("tool_calls", ()):
            call = calls.setdefault(part["index"], {"name": None, "arguments": ""})
            if "id" in part:
                call["name"] = part["function"]["name"]
            call["arguments"] += part["function"]["arguments"]
    return list(calls.values())


@pytest.mark.parametrize("tools, choice", [([WEATHER], "required"), ([WEATHER, TIME], {
    "type": "function", "function": {"name": "get_weather"}})])
def test_a_call_cut_by_a_stop_string_is_the_calls_begun_not_markup(real, tools, choice):
    """A stop string that cuts a reply held to calls gave the format's markup as content
    ("<tool_call>\n{...") with finish "stop" and no tool_calls. It is read as a max_tokens
    cut is: content null, the calls begun; finish "stop" stays, whole and streamed alike."""
    fields = {"tools": tools, "tool_choice": choice, "temperature": 0}
    full = chat(real, **fields)["choices"][0]
    assert full["finish_reason"] == "tool_calls"
    (call,) = full["message"]["tool_calls"]
    arguments = call["function"]["arguments"]
    assert arguments.startswith('{"city": ')
    for stop, whole_arguments in (('"city"', False), ("</tool_call>", True)):
        reply = chat(real, **fields, stop=[stop])["choices"][0]
        assert reply["finish_reason"] == "stop", (stop, reply)
        message = reply["message"]
        assert message["content"] is None, (stop, message)
        (cut,) = message["tool_calls"]
        assert cut["function"]["name"] == "get_weather"
        assert (cut["function"]["arguments"] == arguments) == whole_arguments, (stop, cut)
        assert arguments.startswith(cut["function"]["arguments"]), (stop, cut)
        chunks = events(real, "/v1/chat/completions", {"model": "tinygpt", "messages": HI,
                                                       "max_tokens": 120, **fields,
                                                       "stop": [stop]})
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
        assert streamed_calls(chunks) == [{"name": "get_weather",
                                           "arguments": cut["function"]["arguments"]}]


def test_auto_reads_a_stop_strings_cut_as_calls_only_where_a_grammar_held_it():
    """Under "auto" a reply that began with the tag is held to a call by the grammar, so a
    stop string's cut there is the call begun; without a grammar (a tensor-parallel server)
    the model was free and its text stays text, unless max_tokens cut it."""
    from types import SimpleNamespace

    from tinygpt.server.responses import calls_of

    begun = CALL[:CALL.index('"city"')]
    held = SimpleNamespace(reads="tools", grammar=object(), call_name=None)
    free = SimpleNamespace(reads="tools", grammar=None, call_name=None)
    calls, finish = calls_of(held, begun, "stop")
    assert finish == "stop" and [c["function"]["name"] for c in calls] == ["get_weather"]
    assert calls_of(free, begun, "stop") == (None, "stop")
    assert calls_of(free, begun, "length")[0][0]["function"]["name"] == "get_weather"
    assert calls_of(held, "It is sunny.", "stop") == (None, "stop")
    assert calls_of(held, CALL, "stop")[1] == "tool_calls"


def test_a_required_reply_cut_before_any_name_has_no_calls(real):
    reply = chat(real, tools=[WEATHER, TIME], tool_choice="required", temperature=0,
                 max_tokens=1)["choices"][0]
    assert reply["finish_reason"] == "length"
    assert reply["message"] == {"role": "assistant", "content": None, "tool_calls": []}


def test_the_openai_client_reads_a_cut_call_and_an_auto_reply(real):
    openai = pytest.importorskip("openai")
    client = openai.AsyncOpenAI(base_url="http://tinygpt/v1", api_key="not-needed",
                                http_client=real.client, max_retries=0)
    tools = [WEATHER]

    async def run():
        cut = await client.chat.completions.create(
            model="tinygpt", messages=HI, tools=tools, tool_choice="required",
            temperature=0, max_tokens=60)
        stream = await client.chat.completions.create(
            model="tinygpt", messages=HI, tools=tools, tool_choice="required",
            temperature=0, max_tokens=60, stream=True)
        pieces = [chunk async for chunk in stream]
        auto = await client.chat.completions.create(
            model="tinygpt", messages=HI, tools=tools, tool_choice="auto", max_tokens=16,
            seed=3)
        whole = await client.chat.completions.create(
            model="tinygpt", messages=HI, tools=tools, tool_choice="required", temperature=0,
            max_tokens=120)
        return cut, pieces, auto, whole

    cut, pieces, auto, whole = real.loop.run_until_complete(run())
    choice = cut.choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    streamed = "".join(tc.function.arguments or "" for chunk in pieces if chunk.choices
                       for tc in chunk.choices[0].delta.tool_calls or ())
    assert streamed == call.function.arguments
    assert pieces[-1].choices[0].finish_reason == "length"
    assert isinstance(auto.choices[0].message.content, str)
    assert whole.choices[0].finish_reason == "tool_calls"
    full = whole.choices[0].message.tool_calls[0].function.arguments
    assert call.function.arguments.startswith('{"city": ')         # cut inside them ...
    assert full.startswith(call.function.arguments)                 # ... as far as written


def test_a_named_tool_choice_of_another_type_is_a_400_naming_the_type(real):
    body = {"model": "tinygpt", "messages": HI, "tools": [WEATHER]}
    named = {"function": {"name": "get_weather"}}
    response = real.post("/v1/chat/completions", {**body, "tool_choice": {
        "type": "bogus", **named}})
    assert response.status_code == 400, response.text[:300]
    error = response.json()["error"]
    assert error["param"] == "tool_choice.type"
    assert error["message"] == "tool_choice.type must be 'function', got 'bogus'"
    response = real.post("/v1/chat/completions", {**body, "tool_choice": {
        "type": "function", "function": {"name": "get_time"}}})    # a name that is no tool's
    assert response.status_code == 400 and response.json()["error"]["param"] == "tool_choice"
    assert "'get_time', which is not among the tools" in response.json()["error"]["message"]
