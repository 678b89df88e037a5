"""GLM-4.5 / 4.6 through the real routes, on recorded outputs: its template (tests/text/
templates/glm-4.6.jinja), `<think>` reasoning and XML tool calls shaped into each dialect's
reasoning, text and tool calls, streamed and not."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from .conftest import parse_sse

TEMPLATES = Path(__file__).parent.parent / "text" / "templates"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "days": {"type": "integer"}},
                   "required": ["city"]}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
# What GLM-4.5 writes after `<|assistant|>`: its thinking, a sentence, then a call.
REPLY = ("\n<think>The user wants the weather.</think>\nLet me check.\n<tool_call>get_weather\n"
         "<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n"
         "<arg_value>3</arg_value>\n</tool_call>")


@pytest.fixture
async def glm(aiohttp_client, service):
    from strata.engine.api import create_app

    service.context_tokens = 8192
    service.text = dataclasses.replace(service.text,
                                       chat_template=(TEMPLATES / "glm-4.6.jinja").read_text())
    service.reply_text = REPLY
    return await aiohttp_client(create_app(service))


def _prompt(service) -> str:
    return service.text.decode(list(service.requests[-1].prompt_ids), skip_special=False)


async def test_openai_reasoning_text_and_xml_call(glm, service) -> None:
    body = {"messages": ASK, "tools": [WEATHER], "max_tokens": 300}
    resp = await glm.post("/v1/chat/completions", json=body)
    assert resp.status == 200, await resp.text()
    choice = (await resp.json())["choices"][0]
    message = choice["message"]
    assert choice["finish_reason"] == "tool_calls"
    assert message["reasoning_content"] == "The user wants the weather."
    assert message["content"].strip() == "Let me check."
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 3}
    prompt = _prompt(service)  # the template rendered the tools itself, in its own words
    assert "<arg_key>{arg-key-1}</arg_key>" in prompt and '"get_weather"' in prompt
    assert prompt.endswith("<|assistant|>")

    chunks = parse_sse(await (await glm.post("/v1/chat/completions",
                                             json={**body, "stream": True})).text())
    deltas = [d["choices"][0]["delta"] for _, d in chunks if d != "[DONE]" and d["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == \
        "The user wants the weather."
    assert "".join(d.get("content") or "" for d in deltas).strip() == "Let me check."
    calls = [c for d in deltas for c in d.get("tool_calls") or []]
    assert calls[0]["function"]["name"] == "get_weather"
    arguments = "".join(c["function"].get("arguments") or "" for c in calls)
    assert json.loads(arguments) == {"city": "Paris", "days": 3}


async def test_anthropic_thinking_text_and_tool_use(glm) -> None:
    resp = await glm.post("/v1/messages", json={
        "model": "m", "max_tokens": 3000, "messages": ASK,
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "tools": [{"name": "get_weather", "description": "Weather of a city",
                   "input_schema": WEATHER["function"]["parameters"]}]})
    assert resp.status == 200, await resp.text()
    blocks = (await resp.json())["content"]
    assert [b["type"] for b in blocks] == ["thinking", "text", "tool_use"]
    assert blocks[0]["thinking"] == "The user wants the weather."
    assert blocks[2]["name"] == "get_weather" and blocks[2]["input"] == {"city": "Paris",
                                                                          "days": 3}


async def test_thinking_off_reaches_the_template(glm, service) -> None:
    service.reply_text = "\nHello!"
    resp = await glm.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 20,
        "enable_thinking": False})
    assert resp.status == 200, await resp.text()
    message = (await resp.json())["choices"][0]["message"]
    assert _prompt(service).endswith("<|assistant|>\n<think></think>")
    assert "/nothink" in _prompt(service)
    # Not split (thinking is off): the newline GLM writes after the prompt's empty block stays.
    assert message["content"] == "\nHello!" and not message.get("reasoning_content")


async def test_forced_call_is_constrained_to_the_xml_form(glm, service) -> None:
    resp = await glm.post("/v1/chat/completions", json={
        "messages": ASK, "tools": [WEATHER], "max_tokens": 300,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    assert resp.status == 200, await resp.text()
    grammar = service.requests[-1].sampling.grammar
    assert grammar is not None and "<arg_key>city</arg_key>" in grammar
    assert _prompt(service).endswith("<|assistant|>\n<think></think>")  # thinking off
