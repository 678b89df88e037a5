"""Ollama /api/chat tools and `think`, /api/generate `think`, with the official `ollama` client
on recorded model outputs (Qwen3's real template): calls come back with arguments as objects,
tool results go back to the template, reasoning is split into message.thinking."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import ollama
import pytest

from strata.engine.api import create_app

TEMPLATES = Path(__file__).parent.parent / "text" / "templates"
CALL_TEXT = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
             '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}\n</tool_call>')
THINK_TEXT = "<think>\nThe user greets.\n</think>\n\nHello!"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
ASK = [{"role": "user", "content": "Weather in Paris and Lyon?"}]


@pytest.fixture
async def client(aiohttp_server, service) -> ollama.AsyncClient:
    service.text = dataclasses.replace(service.text,
                                       chat_template=(TEMPLATES / "qwen3.jinja").read_text())
    service.context_tokens = 8192  # the tiny tokenizer spends many tokens on the tool prompt
    server = await aiohttp_server(create_app(service))
    return ollama.AsyncClient(host=f"http://127.0.0.1:{server.port}")


def prompt(service) -> str:
    return service.text.decode(list(service.requests[-1].prompt_ids), skip_special=False)


async def test_tool_calls_whole_and_streamed(client, service):
    service.reply_text = CALL_TEXT
    reply = await client.chat(model=service.model_id, messages=ASK, tools=[WEATHER],
                              think=False, options={"num_predict": 200})
    calls = reply.message.tool_calls
    assert [(c.function.name, dict(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Lyon"})]
    assert not reply.message.content.strip() and reply.done_reason == "stop"
    assert '"name": "get_weather"' in prompt(service)  # Qwen3's template rendered the tools
    parts = [part async for part in await client.chat(
        model=service.model_id, messages=ASK, tools=[WEATHER], think=False, stream=True,
        options={"num_predict": 200})]
    streamed = [c for part in parts for c in part.message.tool_calls or []]
    # Each call comes whole in one line, as Ollama sends it.
    assert [dict(c.function.arguments) for c in streamed] == [{"city": "Paris"},
                                                               {"city": "Lyon"}]
    assert parts[-1].done and not parts[-1].message.tool_calls


async def test_tool_results_go_back_to_the_template(client, service):
    service.reply_text = "It is sunny in Paris."
    history = [*ASK,
               {"role": "assistant", "content": "", "tool_calls": [
                   {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
               {"role": "tool", "content": "sunny, 24 C", "tool_name": "get_weather"}]
    reply = await client.chat(model=service.model_id, messages=history, tools=[WEATHER],
                              think=False)
    assert reply.message.content == "It is sunny in Paris."
    text = prompt(service)
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert "<tool_response>\nsunny, 24 C\n</tool_response>" in text


async def test_think_splits_reasoning_into_thinking(client, service):
    service.reply_text = THINK_TEXT
    reply = await client.chat(model=service.model_id, messages=ASK, think=True)
    assert (reply.message.thinking, reply.message.content) == ("The user greets.", "Hello!")
    parts = [part async for part in await client.chat(
        model=service.model_id, messages=ASK, think=True, stream=True)]
    assert "".join(p.message.thinking or "" for p in parts) == "The user greets."
    assert "".join(p.message.content or "" for p in parts) == "Hello!"
    generated = await client.generate(model=service.model_id, prompt="Hi", think=True)
    assert (generated.thinking, generated.response) == ("The user greets.", "Hello!")
    # think=false reaches Qwen3's template, which then writes an empty think block.
    service.reply_text = "Hello!"
    reply = await client.chat(model=service.model_id, messages=ASK, think=False)
    assert prompt(service).endswith("<think>\n\n</think>\n\n")
    assert reply.message.content == "Hello!" and not reply.message.thinking
    history = [*ASK, {"role": "assistant", "content": "Hello!", "thinking": "Greeted."},
               {"role": "user", "content": "Again?"}]
    await client.chat(model=service.model_id, messages=history, think=False)


@pytest.mark.parametrize(("call", "words"), [
    ({"think": "high"}, "'think' sets a reasoning effort, but this model's chat template"),
    ({"tools": [{"type": "web_search"}]}, "only 'function' tools"),
])
async def test_refusals_name_the_field(client, service, call, words):
    with pytest.raises(ollama.ResponseError) as raised:
        await client.chat(**{"model": service.model_id, "messages": ASK, **call})
    assert raised.value.status_code == 400 and words in raised.value.error
    assert not service.requests


@pytest.mark.parametrize(("messages", "words"), [
    ([{"role": "tool", "content": 3}], "content must be a string"),
    ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "x"}}]}],
     "arguments must be a JSON object"),
    ([{"role": "assistant", "tool_calls": [{"function": {"arguments": {}}}]}],
     "needs a function with a name"),
])
async def test_malformed_histories_are_refused(aiohttp_client, service, messages, words):
    raw = await aiohttp_client(create_app(service))  # what the typed client would not send
    response = await raw.post("/api/chat", json={"model": service.model_id,
                                                 "messages": messages})
    assert response.status == 400 and words in (await response.json())["error"]


async def test_think_on_a_model_that_does_not_think_is_refused(aiohttp_server, service):
    server = await aiohttp_server(create_app(service))  # the tiny ChatML template
    client = ollama.AsyncClient(host=f"http://127.0.0.1:{server.port}")
    for ask in (client.chat(model=service.model_id, messages=ASK, think=True),
                client.generate(model=service.model_id, prompt="Hi", think=True)):
        with pytest.raises(ollama.ResponseError, match="does not think"):
            await ask
    with pytest.raises(ollama.ResponseError, match="'raw'"):
        await client.generate(model=service.model_id, prompt="Hi", raw=True, think=False)
