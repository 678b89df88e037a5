"""Agents against the real `strata serve` and default model: tools, structured output, loops.

A 135M model cannot choose tools well, but a forced tool_choice and a JSON schema are enforced
by constrained decoding, so its calls and JSON must always parse and validate. Short max_tokens
and small schemas (enums, bounded numbers and strings) keep each generation to a few seconds.
"""

from __future__ import annotations

import json

import anthropic
import jsonschema
import openai
import pytest

from tests.e2e.server import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

WEATHER_PARAMS = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}
TIME_PARAMS = {"type": "object", "properties": {
    "zone": {"type": "string", "enum": ["Europe/Paris", "Asia/Tokyo"]}},
    "required": ["zone"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                      "parameters": WEATHER_PARAMS}},
    {"type": "function", "function": {"name": "get_time", "description": "Local time",
                                      "parameters": TIME_PARAMS}}]
PARAMS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 16},
    "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"], "additionalProperties": False}
ASK = [{"role": "user", "content": "What is the weather in Paris, and the time there?"}]


@pytest.fixture(scope="module")
def oai(server: ServerProcess) -> openai.OpenAI:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0,
                           timeout=300)
    yield client
    client.close()


@pytest.fixture(scope="module")
def claude(server: ServerProcess) -> anthropic.Anthropic:
    client = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0,
                                 timeout=300)
    yield client
    client.close()


def _check_call(name: str, arguments: str) -> dict:
    args = json.loads(arguments)
    jsonschema.validate(args, PARAMS[name])
    return args


def test_required_tool_choice_gives_a_valid_call(oai) -> None:
    reply = oai.chat.completions.create(
        model="default", messages=ASK, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, max_tokens=60, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.function.name in PARAMS
    _check_call(call.function.name, call.function.arguments)


def test_named_tool_choice_streams_a_valid_call(oai) -> None:
    stream = oai.chat.completions.create(
        model="default", messages=ASK, tools=TOOLS, max_tokens=60, temperature=0.7, seed=3,
        tool_choice={"type": "function", "function": {"name": "get_time"}}, stream=True)
    pieces, names, finish = [], [], None
    for chunk in stream:
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for delta in choice.delta.tool_calls or []:
            assert delta.index == 0
            if delta.function.name:
                names.append(delta.function.name)
                assert delta.id.startswith("call_")
            pieces.append(delta.function.arguments or "")
    assert names == ["get_time"] and finish == "tool_calls"
    assert len([p for p in pieces if p]) == 1  # sent whole, once they are complete JSON
    _check_call("get_time", "".join(pieces))


def test_json_schema_response_format_validates(oai) -> None:
    reply = oai.chat.completions.create(
        model="default", max_tokens=60, temperature=1.0, seed=7,
        messages=[{"role": "user", "content": "Invent a person."}],
        response_format={"type": "json_schema", "json_schema": {
            "name": "person", "schema": PERSON, "strict": True}})
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content), PERSON)


def test_sdk_parse_with_a_pydantic_model(oai) -> None:
    """openai's structured-output helper: a pydantic model in, a parsed instance out."""
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=16)
        age: int = Field(ge=0, le=120)

    reply = oai.chat.completions.parse(
        model="default", max_tokens=60, temperature=0, response_format=Person,
        messages=[{"role": "user", "content": "Invent a person."}])
    person = reply.choices[0].message.parsed
    assert isinstance(person, Person) and person.name


def test_two_tool_agent_loop_answers(oai) -> None:
    """An agent loop: call each tool (forced by name), feed results back, then answer."""
    results = {"get_weather": "sunny, 21 C", "get_time": "14:05"}
    messages = list(ASK)
    for name in ("get_weather", "get_time"):
        reply = oai.chat.completions.create(
            model="default", messages=messages, tools=TOOLS, max_tokens=60, temperature=0,
            tool_choice={"type": "function", "function": {"name": name}})
        call = reply.choices[0].message.tool_calls[0]
        _check_call(call.function.name, call.function.arguments)
        messages.append(reply.choices[0].message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": call.id, "content": results[name]})
    final = oai.chat.completions.create(model="default", messages=messages, tools=TOOLS,
                                        tool_choice="none", max_tokens=30, temperature=0)
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls


def test_anthropic_forced_tool_use_streams_valid_input(claude) -> None:
    tools = [{"name": n, "description": n, "input_schema": p} for n, p in PARAMS.items()]
    with claude.messages.stream(model="default", max_tokens=60, messages=ASK, tools=tools,
                                tool_choice={"type": "tool", "name": "get_weather"}) as stream:
        kinds = [event.type for event in stream]
        message = stream.get_final_message()
    assert "input_json" in kinds
    assert message.stop_reason == "tool_use"
    (use,) = [b for b in message.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, WEATHER_PARAMS)


def test_anthropic_any_tool_and_structured_output(claude) -> None:
    tools = [{"name": n, "description": n, "input_schema": p} for n, p in PARAMS.items()]
    message = claude.messages.create(model="default", max_tokens=60, messages=ASK,
                                     tools=tools, tool_choice={
                                         "type": "any", "disable_parallel_tool_use": True})
    (use,) = [b for b in message.content if b.type == "tool_use"]
    assert message.stop_reason == "tool_use"
    jsonschema.validate(use.input, PARAMS[use.name])
    message = claude.messages.create(
        model="default", max_tokens=60, messages=[{"role": "user", "content": "A person?"}],
        output_config={"format": {"type": "json_schema", "schema": PERSON}})
    jsonschema.validate(json.loads(message.content[0].text), PERSON)


def test_langchain_agent_runs_two_tools_and_answers(server: ServerProcess) -> None:
    """langchain-openai's ChatOpenAI, unchanged: bind_tools, ToolMessages, a final answer."""
    langchain_openai = pytest.importorskip("langchain_openai")
    from typing import Literal

    from langchain_core.messages import HumanMessage
    from langchain_core.tools import tool
    from pydantic import BaseModel, Field

    class WeatherArgs(BaseModel):
        city: Literal["Paris", "London", "Tokyo"]
        days: int = Field(ge=1, le=7)

    class TimeArgs(BaseModel):
        zone: Literal["Europe/Paris", "Asia/Tokyo"]

    runs: list[str] = []

    @tool(args_schema=WeatherArgs)
    def get_weather(city: str, days: int) -> str:
        """Weather forecast for a city."""
        runs.append("get_weather")
        return f"sunny in {city} for {days} days"

    @tool(args_schema=TimeArgs)
    def get_time(zone: str) -> str:
        """Local time in a zone."""
        runs.append("get_time")
        return f"14:05 in {zone}"

    tools = {"get_weather": get_weather, "get_time": get_time}
    llm = langchain_openai.ChatOpenAI(base_url=f"{server.base_url}/v1", api_key="unused",
                                      model="default", temperature=0, max_tokens=60,
                                      max_retries=0, timeout=300)
    messages = [HumanMessage(ASK[0]["content"])]
    for name in tools:
        reply = llm.bind_tools(list(tools.values()), tool_choice=name).invoke(messages)
        assert [c["name"] for c in reply.tool_calls] == [name]
        messages.append(reply)
        messages += [tools[c["name"]].invoke(c) for c in reply.tool_calls]
    answer = llm.invoke(messages)
    assert runs == ["get_weather", "get_time"]
    assert isinstance(answer.content, str) and answer.content.strip()


def test_ollama_format_schema_validates(server: ServerProcess) -> None:
    """Ollama's client with `format` as a JSON schema: the answer is JSON that validates."""
    ollama = pytest.importorskip("ollama")
    client = ollama.Client(host=server.base_url, timeout=300)
    name = client.list().models[0].model
    reply = client.chat(model=name, format=PERSON, options={"num_predict": 60, "seed": 5},
                        messages=[{"role": "user", "content": "Invent a person."}])
    jsonschema.validate(json.loads(reply.message.content), PERSON)


RESPONSES_TOOLS = [{"type": "function", "name": t["function"]["name"],
                    "description": t["function"]["description"],
                    "parameters": t["function"]["parameters"]} for t in TOOLS]


def test_responses_required_tool_choice_gives_a_valid_call_and_takes_its_output(oai) -> None:
    first = oai.responses.create(model="default", input=ASK[0]["content"],
                                 tools=RESPONSES_TOOLS, tool_choice="required",
                                 parallel_tool_calls=False, max_output_tokens=60,
                                 temperature=0)
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.call_id.startswith("call_") and call.status == "completed"
    _check_call(call.name, call.arguments)
    follow = oai.responses.create(
        model="default", previous_response_id=first.id, tools=RESPONSES_TOOLS,
        tool_choice="none", max_output_tokens=8, temperature=0,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert follow.status in ("completed", "incomplete") and follow.output[0].type == "message"
    assert follow.usage.input_tokens_details.cached_tokens > 0  # the first turn's slot


def test_responses_named_tool_choice_streams_a_valid_call(oai) -> None:
    stream = oai.responses.create(model="default", input=ASK[0]["content"],
                                  tools=RESPONSES_TOOLS, max_output_tokens=60, temperature=0,
                                  tool_choice={"type": "function", "name": "get_time"},
                                  stream=True)
    events = list(stream)
    deltas = "".join(e.delta for e in events
                     if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done.arguments == deltas
    _check_call("get_time", done.arguments)
    assert events[-1].type == "response.completed"


class Person:
    """PERSON as a pydantic model (built lazily: pydantic is imported by the SDK anyway)."""

    @staticmethod
    def model():
        from pydantic import BaseModel, Field

        class PersonModel(BaseModel):
            name: str = Field(min_length=1, max_length=16)
            age: int = Field(ge=0, le=120)

        return PersonModel


def test_responses_parse_and_stream_with_a_pydantic_model(oai) -> None:
    """client.responses.parse / .stream with text_format (issue 51 item 9)."""
    model = Person.model()
    ask = {"model": "default", "input": "Invent a person.", "max_output_tokens": 60,
           "temperature": 0, "text_format": model}
    parsed = oai.responses.parse(**ask)
    assert parsed.status == "completed"
    assert isinstance(parsed.output_parsed, model) and parsed.output_parsed.name
    with oai.responses.stream(**ask) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == parsed.output_text  # greedy: the same
    assert final.output_parsed == parsed.output_parsed


def test_langchain_responses_mode_structured_output(server: ServerProcess) -> None:
    """langchain-openai's ChatOpenAI on the Responses API, with_structured_output(pydantic)."""
    langchain_openai = pytest.importorskip("langchain_openai")
    model = Person.model()
    llm = langchain_openai.ChatOpenAI(base_url=f"{server.base_url}/v1", api_key="unused",
                                      model="default", temperature=0, max_tokens=60,
                                      max_retries=0, timeout=300, use_responses_api=True)
    person = llm.with_structured_output(model, method="json_schema").invoke("Invent a person.")
    assert isinstance(person, model) and person.name


def test_a_schema_without_additional_properties_gives_only_its_keys(oai) -> None:
    """No additionalProperties (as pydantic, LangChain and `llm --schema` write schemas): the
    object is closed, so the model stops after its keys instead of adding more (item 10)."""
    open_person = {k: v for k, v in PERSON.items() if k != "additionalProperties"}
    for seed in (1, 2, 3):
        reply = oai.chat.completions.create(
            model="default", max_tokens=60, temperature=1.0, seed=seed,
            messages=[{"role": "user", "content": "Invent a person with many details."}],
            response_format={"type": "json_schema", "json_schema": {
                "name": "person", "schema": open_person}})
        assert reply.choices[0].finish_reason == "stop"
        assert set(json.loads(reply.choices[0].message.content)) == {"name", "age"}


def test_a_forced_call_cut_by_max_tokens_is_not_returned_and_such_history_is_taken(oai) -> None:
    """A forced call that max_tokens cuts off comes back as finish `length` without the call;
    a history holding a cut call (as servers used to return) is accepted (item 12)."""
    forced = {"type": "function", "function": {"name": "get_weather"}}

    def ask(max_tokens: int):
        return oai.chat.completions.create(model="default", messages=ASK, tools=TOOLS,
                                           tool_choice=forced, max_tokens=max_tokens,
                                           temperature=0)

    num_tokens = ask(60).usage.completion_tokens  # the whole call, greedy: the same each time
    num_dropped = 0
    for cut in range(num_tokens - 12, num_tokens):  # some end inside the arguments
        choice = ask(cut).choices[0]
        assert choice.finish_reason == "length", cut
        for call in choice.message.tool_calls or []:  # cut after the arguments: whole
            _check_call(call.function.name, call.function.arguments)
        num_dropped += not choice.message.tool_calls
    assert num_dropped > 0
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Pa'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    follow = oai.chat.completions.create(model="default", messages=history, tools=TOOLS,
                                         tool_choice=forced, max_tokens=60, temperature=0)
    (call,) = follow.choices[0].message.tool_calls
    _check_call(call.function.name, call.function.arguments)
