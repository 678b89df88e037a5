"""Tools, structured output and reasoning through the real routes, on recorded model outputs.

The fake service answers with a fixed text (what a model wrote), tokenized by a real tokenizer;
the routes must shape it into each dialect's tool calls and blocks, streamed and not. What the
engine does with the grammar is tested on the real model (tests/core/test_constraint.py,
tests/e2e/test_agents.py); here only that the right grammar is sent.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from .conftest import parse_sse

TEMPLATES = Path(__file__).parent.parent / "text" / "templates"
CALL_TEXT = ('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
             '\n</tool_call>')
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(autouse=True)
def _long_context(service) -> None:
    service.context_tokens = 8192  # the tiny tokenizer spends many tokens on the tool prompt


def _prompt(service) -> str:
    return service.text.decode(list(service.requests[-1].prompt_ids), skip_special=False)


async def test_openai_tool_call_whole(client, service) -> None:
    service.reply_text = CALL_TEXT
    resp = await client.post("/v1/chat/completions", json={
        "messages": ASK, "tools": [WEATHER], "max_tokens": 200})
    assert resp.status == 200, await resp.text()
    choice = (await resp.json())["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    call = choice["message"]["tool_calls"][0]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert choice["message"]["content"] == "Sure.\n"
    # The tiny ChatML template ignores tools: Strata wrote the Hermes tool prompt.
    assert "<tools>" in _prompt(service) and '"get_weather"' in _prompt(service)
    assert service.requests[-1].sampling.grammar is None  # auto: the model decides


async def test_openai_tool_call_stream(client, service) -> None:
    service.reply_text = CALL_TEXT
    resp = await client.post("/v1/chat/completions", json={
        "messages": ASK, "tools": [WEATHER], "max_tokens": 200, "stream": True})
    chunks = [d for _, d in parse_sse(await resp.text()) if d != "[DONE]"]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    first = calls[0]
    assert first["index"] == 0 and first["id"].startswith("call_")
    assert first["function"] == {"name": "get_weather", "arguments": ""}
    assert all("id" not in c and "name" not in c["function"] for c in calls[1:])
    assert len(calls) == 2  # the call goes out whole, once its arguments are complete JSON
    assert json.loads("".join(c["function"]["arguments"] for c in calls)) == {"city": "Paris"}
    assert "".join(d.get("content") or "" for d in deltas) == "Sure.\n"
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_weather"}}])
async def test_forced_tool_choice_sends_a_grammar(client, service, choice) -> None:
    service.reply_text = CALL_TEXT
    resp = await client.post("/v1/chat/completions", json={
        "messages": ASK, "tools": [WEATHER], "tool_choice": choice, "max_tokens": 200})
    assert resp.status == 200
    grammar = service.requests[-1].sampling.grammar
    assert grammar is not None and "get_weather" in grammar and "<tool_call>" in grammar


async def test_tool_choice_none_keeps_the_text(client, service) -> None:
    service.reply_text = CALL_TEXT
    resp = await client.post("/v1/chat/completions", json={
        "messages": ASK, "tools": [WEATHER], "tool_choice": "none", "max_tokens": 200})
    message = (await resp.json())["choices"][0]["message"]
    assert message["content"] == CALL_TEXT and "tool_calls" not in message


async def test_history_with_calls_and_results_renders_hermes_blocks(client, service) -> None:
    service.reply_text = "It is sunny."
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    resp = await client.post("/v1/chat/completions", json={
        "messages": history, "tools": [WEATHER], "max_tokens": 50})
    body = await resp.json()
    assert body["choices"][0]["finish_reason"] == "stop"
    prompt = _prompt(service)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in prompt


async def test_anthropic_tool_use_whole_and_streamed(client, service) -> None:
    service.reply_text = CALL_TEXT
    tools = [{"name": "get_weather", "description": "Weather of a city",
              "input_schema": WEATHER["function"]["parameters"]}]
    body = {"model": "m", "max_tokens": 200, "messages": ASK, "tools": tools}
    message = await (await client.post("/v1/messages", json=body)).json()
    assert message["stop_reason"] == "tool_use"
    assert message["content"][0] == {"type": "text", "text": "Sure.\n"}
    use = message["content"][1]
    assert use["type"] == "tool_use" and use["id"].startswith("toolu_")
    assert use["name"] == "get_weather" and use["input"] == {"city": "Paris"}
    events = parse_sse(await (await client.post("/v1/messages",
                                                json={**body, "stream": True})).text())
    starts = [d["content_block"] for n, d in events if n == "content_block_start"]
    assert [b["type"] for b in starts] == ["text", "tool_use"]
    assert starts[1]["name"] == "get_weather" and starts[1]["input"] == {}
    partial = [d["delta"]["partial_json"] for n, d in events
               if n == "content_block_delta" and d["delta"]["type"] == "input_json_delta"]
    assert json.loads("".join(partial)) == {"city": "Paris"}
    delta = next(d for n, d in events if n == "message_delta")
    assert delta["delta"]["stop_reason"] == "tool_use"


async def test_anthropic_tool_result_history_and_count_tokens(client, service) -> None:
    tools = [{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}]
    history = [*ASK, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]}]
    plain = await (await client.post("/v1/messages/count_tokens",
                                     json={"model": "m", "messages": history})).json()
    with_tools = await (await client.post("/v1/messages/count_tokens", json={
        "model": "m", "messages": history, "tools": tools})).json()
    assert with_tools["input_tokens"] > plain["input_tokens"]
    resp = await client.post("/v1/messages", json={
        "model": "m", "max_tokens": 20, "messages": history, "tools": tools})
    assert resp.status == 200
    assert "<tool_response>\nsunny\n</tool_response>" in _prompt(service)


async def test_json_schema_sends_a_grammar(client, service) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    for body in ({"response_format": {"type": "json_schema",
                                      "json_schema": {"name": "x", "schema": schema}}},
                 {"json_schema": schema}, {"response_format": {"type": "json_object"}},
                 {"grammar": 'root ::= "yes" | "no"'}):
        resp = await client.post("/v1/chat/completions",
                                 json={"messages": ASK, "max_tokens": 5, **body})
        assert resp.status == 200, body
        assert service.requests[-1].sampling.grammar is not None
    resp = await client.post("/v1/messages", json={
        "model": "m", "max_tokens": 5, "messages": ASK,
        "output_config": {"format": {"type": "json_schema", "schema": schema}}})
    assert resp.status == 200 and service.requests[-1].sampling.grammar is not None


@pytest.mark.parametrize(("path", "body", "needle"), [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "schema": {"not": {"type": "string"}}}}}, "not"),
    ("/v1/chat/completions", {"reasoning_effort": "high"}, "'reasoning_effort'"),
    ("/v1/chat/completions", {"mirostat": 2}, "'mirostat'"),
    ("/v1/chat/completions", {"enable_thinking": True}, "does not think"),
    ("/v1/chat/completions", {"chat_template_kwargs": {"foo": 1}}, "'foo'"),
    ("/v1/chat/completions", {"tools": [WEATHER], "tool_choice": "required",
                              "response_format": {"type": "json_object"}}, "combined"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "no tools"),
    ("/v1/chat/completions", {"tools": [{"type": "web_search"}]}, "'web_search'"),
    ("/v1/chat/completions", {"grammar": "root ::= ("}, "grammar"),
    ("/v1/messages", {"thinking": {"type": "enabled", "budget_tokens": 2000},
                      "max_tokens": 4000}, "does not think"),
    ("/v1/messages", {"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     "server tools"),
    ("/v1/messages", {"container": "x"}, "'container'"),
])
async def test_unsupported_asks_are_400s_naming_them(client, path, body, needle) -> None:
    payload = {"model": "m", "messages": ASK, "max_tokens": 5, **body}
    resp = await client.post(path, json=payload)
    assert resp.status == 400
    text = await resp.text()
    assert needle in text, text


async def test_reasoning_is_split_on_a_thinking_template(aiohttp_client, service) -> None:
    from strata.engine.api import create_app

    service.text = dataclasses.replace(service.text,
                                       chat_template=(TEMPLATES / "qwen3.jinja").read_text())
    service.reply_text = "<think>\nThe user greets.\n</think>\n\nHello!"
    client = await aiohttp_client(create_app(service))
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 60}
    message = (await (await client.post("/v1/chat/completions", json=body)).json()
               )["choices"][0]["message"]
    assert message["reasoning_content"] == "The user greets." and message["content"] == "Hello!"
    chunks = parse_sse(await (await client.post("/v1/chat/completions",
                                                json={**body, "stream": True})).text())
    deltas = [d["choices"][0]["delta"] for _, d in chunks if d != "[DONE]" and d["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "The user greets."
    assert "".join(d.get("content") or "" for d in deltas) == "Hello!"
    # enable_thinking reaches Qwen3's template, which then writes an empty think block.
    await client.post("/v1/chat/completions", json={**body, "enable_thinking": False})
    assert _prompt(service).endswith("<think>\n\n</think>\n\n")
    events = parse_sse(await (await client.post("/v1/messages", json={
        "model": "m", "max_tokens": 3000, "stream": True, "messages": body["messages"],
        "thinking": {"type": "enabled", "budget_tokens": 1024}})).text())
    starts = [d["content_block"]["type"] for n, d in events if n == "content_block_start"]
    assert starts == ["thinking", "text"]


async def test_apply_template_shows_the_chat_prompt_with_its_tools(client, service) -> None:
    service.reply_text = CALL_TEXT
    body = {"messages": ASK, "tools": [WEATHER], "tool_choice": "auto", "temperature": 0.2}
    chat = await client.post("/v1/chat/completions", json={**body, "max_tokens": 200})
    assert chat.status == 200, await chat.text()
    shown = await client.post("/apply-template", json=body)
    assert shown.status == 200, await shown.text()
    prompt = (await shown.json())["prompt"]
    assert "<tools>" in prompt and '"get_weather"' in prompt
    assert prompt == _prompt(service)  # what the chat request fed the model
    asked = len(service.requests)
    for bad, param in (({"temperature": -1}, "temperature"), ({"top_kk": 3}, "top_kk"),
                       ({"tool_choice": "sometimes"}, "tool_choice")):
        resp = await client.post("/apply-template", json={**body, **bad})
        assert resp.status == 400, bad
        assert (await resp.json())["error"]["param"] == param
    assert len(service.requests) == asked  # nothing generated


async def test_apply_template_shows_the_prompt_a_structured_chat_gets(aiohttp_client,
                                                                      service) -> None:
    """A JSON schema turns a switchable thinking template's thinking off in chat's prompt:
    /apply-template, reading the body as chat does, shows that prompt, and refuses what
    chat refuses (a schema that is not one, or thinking asked for beside it)."""
    from strata.engine.api import create_app

    service.text = dataclasses.replace(service.text,
                                       chat_template=(TEMPLATES / "qwen3.jinja").read_text())
    service.reply_text = '{"city": "Paris"}'
    client = await aiohttp_client(create_app(service))
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    body = {"messages": ASK, "response_format": {"type": "json_schema", "json_schema": {
        "name": "place", "schema": schema}}}
    chat = await client.post("/v1/chat/completions", json={**body, "max_tokens": 40})
    assert chat.status == 200, await chat.text()
    shown = await client.post("/apply-template", json=body)
    assert shown.status == 200, await shown.text()
    prompt = (await shown.json())["prompt"]
    assert prompt == _prompt(service) and prompt.endswith("<think>\n\n</think>\n\n")
    asked = len(service.requests)
    for bad, param in (({"response_format": {"type": "json_schema", "json_schema": {
            "name": "place", "schema": {"type": "objekt"}}}},
                        "response_format.json_schema.schema"),
                       ({"enable_thinking": True}, "enable_thinking")):
        resp = await client.post("/apply-template", json={**body, **bad})
        assert resp.status == 400, (bad, await resp.text())
        assert (await resp.json())["error"]["param"] == param
    assert len(service.requests) == asked  # nothing generated
