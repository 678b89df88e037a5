"""A tool call cut off by max_tokens never goes out half-written, on any API, streamed or not;
and a history holding such a call (from any server) is taken back (issue 51 item 12).

The fake service writes a recorded Hermes call and stops at max_tokens, as the engine does; the
routes must drop the cut call (finish `length`) instead of returning arguments no one can parse.
"""

from __future__ import annotations

import json

import anthropic
import ollama
import openai
import pytest

from strata.engine.api import create_app

from .conftest import parse_sse

CALL_TEXT = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
             '"days": 3}}\n</tool_call>')
PARAMS = {"type": "object", "properties": {"city": {"type": "string"},
                                           "days": {"type": "integer"}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                            "parameters": PARAMS}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
FORCED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(autouse=True)
def _cut_call(service) -> None:
    service.context_tokens = 8192  # the tiny tokenizer spends many tokens on the tool prompt
    service.reply_text = CALL_TEXT


def cut_tokens(service) -> int:
    """A max_tokens that stops the recorded call inside its arguments (after '"Paris", ')."""
    ids = service.reply_ids()
    for n in range(1, len(ids)):
        if '"Paris",' in service.text.decode(ids[:n]):
            return n
    raise AssertionError("the recorded call has no '\"Paris\",'")


@pytest.fixture
async def base_url(aiohttp_server, service):
    server = await aiohttp_server(create_app(service))
    return f"http://127.0.0.1:{server.port}"


async def test_openai_chat_drops_the_cut_call_whole_and_streamed(client, service) -> None:
    body = {"messages": ASK, "tools": [WEATHER], "tool_choice": FORCED,
            "max_tokens": cut_tokens(service)}
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status == 200, await resp.text()
    choice = (await resp.json())["choices"][0]
    assert choice["finish_reason"] == "length"
    assert "tool_calls" not in choice["message"] and choice["message"]["content"] == ""
    resp = await client.post("/v1/chat/completions", json={**body, "stream": True})
    chunks = [d for _, d in parse_sse(await resp.text()) if d != "[DONE]"]
    assert not [c for c in chunks if c["choices"][0]["delta"].get("tool_calls")]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    # With room to finish, the same call goes out, as one complete piece when streamed.
    resp = await client.post("/v1/chat/completions", json={**body, "max_tokens": 200,
                                                            "stream": True})
    chunks = [d for _, d in parse_sse(await resp.text()) if d != "[DONE]"]
    calls = [c["choices"][0]["delta"]["tool_calls"][0] for c in chunks
             if c["choices"][0]["delta"].get("tool_calls")]
    arguments = "".join(c["function"]["arguments"] for c in calls)
    assert json.loads(arguments) == {"city": "Paris", "days": 3}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


async def test_openai_sdk_sends_back_a_cut_call_it_got_elsewhere(base_url, service) -> None:
    """A history whose assistant call has arguments that are not JSON (cut off by another
    server, or by an older Strata) is accepted and reaches the template as written."""
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="k", max_retries=0)
    service.reply_text = "It is sunny."
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Pa'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    reply = await client.chat.completions.create(model="m", messages=history,
                                                 tools=[WEATHER], max_tokens=20)
    assert reply.choices[0].message.content == "It is sunny."
    prompt = service.text.decode(list(service.requests[-1].prompt_ids), skip_special=False)
    assert '{\\"city\\": \\"Pa' in prompt  # the Hermes history prints it as a JSON string
    await client.close()


async def test_responses_drop_the_cut_call_and_take_a_cut_history(base_url, service) -> None:
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="k", max_retries=0)
    tools = [{"type": "function", "name": "get_weather", "parameters": PARAMS}]
    ask = {"model": "m", "input": ASK[0]["content"], "tools": tools,
           "tool_choice": {"type": "function", "name": "get_weather"},
           "max_output_tokens": cut_tokens(service)}
    response = await client.responses.create(**ask)
    assert response.status == "incomplete"
    assert [item.type for item in response.output] == ["message"]
    events = [e async for e in await client.responses.create(**ask, stream=True)]
    kinds = [e.type for e in events]
    assert not [k for k in kinds if k.startswith("response.function_call")]
    assert kinds[-1] == "response.incomplete"
    service.reply_text = "It is sunny."
    follow = await client.responses.create(model="m", tools=tools, max_output_tokens=20, input=[
        {"role": "user", "content": ASK[0]["content"]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Pa'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}])
    assert follow.output_text == "It is sunny."
    await client.close()


async def test_anthropic_drops_the_cut_tool_use(base_url, service) -> None:
    client = anthropic.AsyncAnthropic(base_url=base_url, api_key="k", max_retries=0)
    tools = [{"name": "get_weather", "description": "Weather", "input_schema": PARAMS}]
    ask = {"model": "m", "max_tokens": cut_tokens(service), "messages": ASK, "tools": tools,
           "tool_choice": {"type": "tool", "name": "get_weather"}}
    message = await client.messages.create(**ask)
    assert message.stop_reason == "max_tokens"
    assert [b.type for b in message.content] == ["text"]
    async with client.messages.stream(**ask) as stream:
        kinds = [event.type async for event in stream]
        final = await stream.get_final_message()
    assert "input_json" not in kinds and final.stop_reason == "max_tokens"
    assert not [b for b in final.content if b.type == "tool_use"]
    await client.close()


async def test_ollama_drops_the_cut_call(base_url, service) -> None:
    client = ollama.AsyncClient(host=base_url)
    ask = {"model": service.model_id, "messages": ASK, "tools": [WEATHER],
           "options": {"num_predict": cut_tokens(service)}}
    reply = await client.chat(**ask)
    assert reply.done_reason == "length" and not reply.message.tool_calls
    lines = [line async for line in await client.chat(**ask, stream=True)]
    assert not [line for line in lines if line.message.tool_calls]
    assert lines[-1].done_reason == "length"
