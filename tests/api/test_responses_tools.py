"""Function tools on the Responses API through the openai SDK's `client.responses`, on recorded
model outputs (Qwen3's real template): function_call output items, streamed argument events,
function_call_output items going back to the template in a follow-up."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import openai
import pytest

from strata.engine.api import create_app

TEMPLATES = Path(__file__).parent.parent / "text" / "templates"
CALL_TEXT = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
             '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}\n</tool_call>')
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}, "strict": True}
ASK = "Weather in Paris and Lyon?"


@pytest.fixture
async def oai(aiohttp_server, service):
    service.text = dataclasses.replace(service.text,
                                       chat_template=(TEMPLATES / "qwen3.jinja").read_text())
    service.context_tokens = 8192  # the tiny tokenizer spends many tokens on the tool prompt
    server = await aiohttp_server(create_app(service))
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="k",
                                max_retries=0)
    yield client
    await client.close()


def prompt(service) -> str:
    return service.text.decode(list(service.requests[-1].prompt_ids), skip_special=False)


async def test_function_calls_are_output_items(oai, service):
    service.reply_text = CALL_TEXT
    response = await oai.responses.create(model="m", input=ASK, tools=[WEATHER],
                                          max_output_tokens=200)
    calls = [item for item in response.output if item.type == "function_call"]
    assert [json.loads(c.arguments) for c in calls] == [{"city": "Paris"}, {"city": "Lyon"}]
    assert all(c.name == "get_weather" and c.call_id.startswith("call_") and
               c.id.startswith("fc_") and c.status == "completed" for c in calls)
    assert [item.type for item in response.output] == ["function_call", "function_call"]
    assert response.tools[0].name == "get_weather" and response.tool_choice == "auto"
    assert '"name": "get_weather"' in prompt(service)  # Qwen3's template rendered the tools
    assert service.requests[-1].sampling.grammar is None


async def test_streamed_function_call_events(oai, service):
    service.reply_text = CALL_TEXT
    stream = await oai.responses.create(model="m", input=ASK, tools=[WEATHER], stream=True,
                                        max_output_tokens=200)
    events = [event async for event in stream]
    kinds = [e.type for e in events]
    one_call = ["response.output_item.added", "response.function_call_arguments.delta",
                "response.function_call_arguments.done", "response.output_item.done"]
    collapsed = [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]
    assert collapsed == ["response.created", "response.in_progress", *one_call, *one_call,
                         "response.completed"]
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    deltas = [e for e in events if e.type == "response.function_call_arguments.delta"]
    assert json.loads(done[0].arguments) == {"city": "Paris"}
    assert "".join(d.delta for d in deltas if d.item_id == done[1].item_id) == done[1].arguments
    assert [d.output_index for d in done] == [0, 1]
    final = events[-1].response
    assert [item.id for item in final.output] == [d.item_id for d in done]


async def test_function_call_output_goes_back_to_the_template(oai, service):
    service.reply_text = CALL_TEXT
    first = await oai.responses.create(model="m", input=ASK, tools=[WEATHER],
                                       parallel_tool_calls=False)
    (call,) = [item for item in first.output if item.type == "function_call"]  # one: parallel off
    service.reply_text = "Sunny in Paris."
    follow = await oai.responses.create(
        model="m", previous_response_id=first.id, tools=[WEATHER],
        input=[{"type": "function_call_output", "call_id": call.call_id,
                "output": "sunny, 24 C"}])
    assert follow.output_text == "Sunny in Paris."
    text = prompt(service)
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert "<tool_response>\nsunny, 24 C\n</tool_response>" in text
    # The same conversation sent whole, without a stored response, renders the same prompt.
    await oai.responses.create(model="m", tools=[WEATHER], input=[
        {"role": "user", "content": ASK},
        {"type": "function_call", "call_id": call.call_id, "name": "get_weather",
         "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 24 C"}])
    assert prompt(service) == text


async def test_forced_choices_send_a_grammar(oai, service):
    service.reply_text = CALL_TEXT
    for choice in ("required", {"type": "function", "name": "get_weather"}):
        response = await oai.responses.create(model="m", input=ASK, tools=[WEATHER],
                                              tool_choice=choice)
        grammar = service.requests[-1].sampling.grammar
        assert grammar is not None and "get_weather" in grammar
        assert response.output[0].type == "function_call"
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        await oai.responses.create(model="m", input=ASK, tools=[WEATHER],
                                   tool_choice={"type": "function", "name": "other"})
