"""Structured outputs and tool calls through two libraries built on the openai client, against
a live server on SmolLM2-135M-Instruct (one per module; greedy, short replies):

* instructor, in its default TOOLS mode (the model as one function, asked for by name in
  tool_choice, read back from message.tool_calls) and in JSON_SCHEMA mode (response_format
  json_schema, read back from message.content);
* pydantic-ai, with an output type (a `final_result` tool with tool_choice "required") and
  with a function tool whose result goes back to the model as a "tool" message before it
  answers in text.

Both are test-only dependencies (pyproject.toml's dev extra; instructor installed by `make env`
with --no-deps, see there). What the callers give a 135M model, and why:

* `parallel_tool_calls=False` for pydantic-ai, which leaves it unset: with tool_choice
  "required" and several calls allowed, SmolLM2 repeats the same call until max_tokens.
* The function tool is forced on the first step only (a per-step tool_choice, as pydantic-ai's
  documentation shows); left to "auto", SmolLM2 answers in text without calling it.

The pydantic models leave additionalProperties out, as pydantic does by default: the server
closes objects that list their properties (vLLM's default), so the model cannot invent keys.
Models with an Enum use "$ref" into "$defs" (what pydantic writes), in tool parameters too.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Iterator
from typing import Annotated, Literal, NamedTuple

import instructor
import openai
import pytest
from pydantic import BaseModel, Field
from pydantic_ai import Agent
from pydantic_ai.messages import ModelResponse, TextPart, ToolCallPart, ToolReturnPart
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider
from pydantic_ai.usage import UsageLimits

pytestmark = pytest.mark.slow

PARIS = [{"role": "user", "content": "Describe Paris."}]
class City(BaseModel):
    """Every field bounded (a string's maxLength, an int's range, a Literal), no $defs."""

    name: str = Field(max_length=20)
    country: str = Field(max_length=20)
    population_millions: int = Field(ge=0, le=50)
    size: Literal["small", "medium", "large"]


class Continent(enum.StrEnum):
    europe = "Europe"
    asia = "Asia"
    america = "America"
    africa = "Africa"


class Place(BaseModel):
    """An Enum field: pydantic writes it as {"$ref": "#/$defs/Continent"} plus "$defs"."""

    name: str = Field(max_length=20)
    continent: Continent
    size: Literal["small", "medium", "large"]


class Server(NamedTuple):
    base_url: str
    model: str


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    from tinygpt.bench.load import running_server

    with running_server("--model", "smollm2", "--threads", "1",
                        env=dict(os.environ, OMP_NUM_THREADS="1")) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        yield Server(f"{url}/v1", client.models.list().data[0].id)


# -- instructor --------------------------------------------------------------------------------

def instructor_extract(server: Server, mode, response_model: type[BaseModel]):
    """(the validated instance, the raw completion), with one try: max_retries=0 lets a
    failure show instead of being retried away."""
    client = instructor.from_openai(
        openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=120),
        mode=mode)
    return client.chat.completions.create_with_completion(
        model=server.model, messages=PARIS, response_model=response_model, max_retries=0,
        max_tokens=80, temperature=0)


def test_instructor_tools_mode_gets_a_validated_instance(server):
    assert instructor.from_openai(openai.OpenAI(base_url=server.base_url, api_key="x")).mode \
        == instructor.Mode.TOOLS                                   # the mode it uses by default
    city, completion = instructor_extract(server, instructor.Mode.TOOLS, City)
    assert isinstance(city, City)
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "City"
    assert City.model_validate_json(call.function.arguments).model_dump() == city.model_dump()


def test_instructor_json_schema_mode_gets_a_validated_instance_with_an_enum(server):
    place, completion = instructor_extract(server, instructor.Mode.JSON_SCHEMA, Place)
    assert isinstance(place, Place) and isinstance(place.continent, Continent)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert Place.model_validate_json(choice.message.content).model_dump() == \
        place.model_dump()


def test_instructor_tools_mode_with_an_enum(server):
    place, completion = instructor_extract(server, instructor.Mode.TOOLS, Place)
    assert isinstance(place, Place) and completion.choices[0].finish_reason == "tool_calls"


# -- pydantic-ai -------------------------------------------------------------------------------

SETTINGS = {"temperature": 0, "max_tokens": 80, "parallel_tool_calls": False}


def chat_model(server: Server) -> OpenAIChatModel:
    """A fresh async client per test: pydantic-ai's run_sync runs each run on its own loop."""
    client = openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0,
                                timeout=120)
    return OpenAIChatModel(server.model, provider=OpenAIProvider(openai_client=client))


def test_pydantic_ai_output_type_gets_a_validated_instance(server):
    agent = Agent(chat_model(server), output_type=City, model_settings=SETTINGS, retries=0)
    result = agent.run_sync("Describe Paris.", usage_limits=UsageLimits(request_limit=1))
    assert isinstance(result.output, City)
    (response,) = [m for m in result.all_messages() if isinstance(m, ModelResponse)]
    assert [p.tool_name for p in response.parts if isinstance(p, ToolCallPart)] == [
        "final_result"]


def test_pydantic_ai_calls_a_tool_and_answers_after_its_result(server):
    calls: list[str] = []
    agent = Agent(chat_model(server), retries=0, model_settings=lambda ctx: {
        **SETTINGS, "max_tokens": 40,
        "tool_choice": ["get_weather"] if ctx.run_step <= 1 else "auto"})

    @agent.tool_plain
    def get_weather(city: Annotated[str, Field(max_length=20)]) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"Sunny, 21 C in {city}"

    result = agent.run_sync("What is the weather in Paris?",
                            usage_limits=UsageLimits(request_limit=3))
    assert len(calls) == 1 and 0 < len(calls[0]) <= 20
    assert result.usage.requests == 2
    first, returned, last = result.all_messages()[1:]
    assert [(p.tool_name, p.args_as_dict()) for p in first.parts
            if isinstance(p, ToolCallPart)] == [("get_weather", {"city": calls[0]})]
    assert [p.content for p in returned.parts if isinstance(p, ToolReturnPart)] == [
        f"Sunny, 21 C in {calls[0]}"]
    assert isinstance(result.output, str) and result.output
    assert any(isinstance(p, TextPart) for p in last.parts)


def test_pydantic_ai_output_type_with_an_enum(server):
    agent = Agent(chat_model(server), output_type=Place, model_settings=SETTINGS, retries=0)
    result = agent.run_sync("Describe Paris.", usage_limits=UsageLimits(request_limit=1))
    assert isinstance(result.output, Place)
