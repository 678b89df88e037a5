"""Phi-4-mini through the real routes, on recorded outputs: its real template (tests/text/
templates/microsoft-phi-4-mini-instruct.jinja) given the tools on the system message, and its
`<|tool_call|>[...]<|/tool_call|>` calls (special tokens, as in its tokenizer) shaped into
each dialect's text and tool calls, streamed and not; a malformed call is text."""

from __future__ import annotations

import json

import pytest

from strata.engine.text import load_text_assets

from .conftest import parse_sse
from .tiny_text import write_tiny_phi4_dir

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "days": {"type": "integer"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Time in a zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
# What Phi-4-mini writes after `<|assistant|>`: a sentence, then two calls in one list (the
# second's arguments as a JSON string).
REPLY = ('Let me check.<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", '
         '"days": 3}}, {"name": "get_time", "arguments": "{\\"zone\\": \\"Europe/Paris\\"}"}]'
         "<|/tool_call|>")


@pytest.fixture(scope="module")
def phi4_text(tmp_path_factory):
    return load_text_assets(write_tiny_phi4_dir(tmp_path_factory.mktemp("phi4")))


@pytest.fixture
async def phi4(aiohttp_client, service, phi4_text):
    from strata.engine.api import create_app

    service.context_tokens = 8192
    service.text = phi4_text
    service.reply_text = REPLY
    return await aiohttp_client(create_app(service))


def _prompt(service) -> str:
    return service.text.decode(list(service.requests[-1].prompt_ids), skip_special=False)


async def test_openai_text_and_calls(phi4, service) -> None:
    body = {"messages": ASK, "tools": [WEATHER, TIME], "max_tokens": 300}
    resp = await phi4.post("/v1/chat/completions", json=body)
    assert resp.status == 200, await resp.text()
    choice = (await resp.json())["choices"][0]
    message = choice["message"]
    assert choice["finish_reason"] == "tool_calls"
    assert message["content"] == "Let me check."
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather", "get_time"]
    assert [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]] == [
        {"city": "Paris", "days": 3}, {"zone": "Europe/Paris"}]
    # The template wrote the tools itself, from the system message, in its own tokens.
    assert _prompt(service).startswith(
        '<|system|>You are a helpful assistant with some tools.<|tool|>[{"name": "get_weather"')
    assert _prompt(service).endswith("<|/tool|><|end|><|user|>Weather in Paris?<|end|>"
                                     "<|assistant|>")

    chunks = parse_sse(await (await phi4.post("/v1/chat/completions",
                                              json={**body, "stream": True})).text())
    deltas = [d["choices"][0]["delta"] for _, d in chunks if d != "[DONE]" and d["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == "Let me check."
    calls = [c for d in deltas for c in d.get("tool_calls") or []]
    assert [c["function"]["name"] for c in calls if c["function"].get("name")] == [
        "get_weather", "get_time"]
    arguments = ["".join(c["function"].get("arguments") or "" for c in calls
                         if c["index"] == i) for i in (0, 1)]
    assert [json.loads(a) for a in arguments] == [{"city": "Paris", "days": 3},
                                                  {"zone": "Europe/Paris"}]
    assert chunks[-2][1]["choices"][0]["finish_reason"] == "tool_calls"


async def test_the_tool_loop_renders_calls_and_results_as_phi4_does(phi4, service) -> None:
    service.reply_text = "It is sunny in Paris."
    history = [
        {"role": "system", "content": "Be brief."}, *ASK,
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    resp = await phi4.post("/v1/chat/completions", json={
        "messages": history, "tools": [WEATHER], "max_tokens": 50})
    assert resp.status == 200, await resp.text()
    choice = (await resp.json())["choices"][0]
    assert choice["message"]["content"] == "It is sunny in Paris."
    assert choice["finish_reason"] == "stop" and not choice["message"].get("tool_calls")
    prompt = _prompt(service)
    assert prompt.startswith('<|system|>Be brief.<|tool|>[{"name": "get_weather"')
    assert prompt.endswith(
        '<|assistant|><|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]'
        "<|/tool_call|><|end|><|tool|>sunny<|end|><|assistant|>")


@pytest.mark.parametrize("reply", [
    '<|tool_call|>get_weather(city="Paris")<|/tool_call|>',  # not JSON
    '<|tool_call|>[{"city": "Paris"}]<|/tool_call|>',  # no name
])
async def test_a_malformed_call_is_plain_content(phi4, service, reply) -> None:
    service.reply_text = reply
    body = {"messages": ASK, "tools": [WEATHER], "max_tokens": 300}
    resp = await phi4.post("/v1/chat/completions", json=body)
    assert resp.status == 200, await resp.text()
    choice = (await resp.json())["choices"][0]
    assert choice["message"]["content"] == reply and not choice["message"].get("tool_calls")
    assert choice["finish_reason"] == "stop"
    chunks = parse_sse(await (await phi4.post("/v1/chat/completions",
                                              json={**body, "stream": True})).text())
    deltas = [d["choices"][0]["delta"] for _, d in chunks if d != "[DONE]" and d["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == reply
    assert not any(d.get("tool_calls") for d in deltas)


async def test_anthropic_text_and_tool_use(phi4) -> None:
    resp = await phi4.post("/v1/messages", json={
        "model": "m", "max_tokens": 300, "messages": ASK,
        "tools": [{"name": t["function"]["name"], "description": t["function"]["description"],
                   "input_schema": t["function"]["parameters"]} for t in (WEATHER, TIME)]})
    assert resp.status == 200, await resp.text()
    blocks = (await resp.json())["content"]
    assert [b["type"] for b in blocks] == ["text", "tool_use", "tool_use"]
    assert blocks[0]["text"] == "Let me check."
    assert blocks[1]["input"] == {"city": "Paris", "days": 3}
    assert blocks[2]["name"] == "get_time" and blocks[2]["input"] == {"zone": "Europe/Paris"}


async def test_forced_call_is_constrained_to_a_list_of_calls(phi4, service) -> None:
    resp = await phi4.post("/v1/chat/completions", json={
        "messages": ASK, "tools": [WEATHER, TIME], "max_tokens": 300,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    assert resp.status == 200, await resp.text()
    grammar = service.requests[-1].sampling.grammar
    # The list the model writes after its (special) call token; the parser reads it bare.
    assert grammar is not None and grammar.startswith('start: "[" call "]"'), grammar


async def test_ollama_calls_with_object_arguments(phi4, service) -> None:
    resp = await phi4.post("/api/chat", json={
        "model": service.model_id, "messages": ASK, "tools": [WEATHER, TIME], "stream": False})
    assert resp.status == 200, await resp.text()
    message = (await resp.json())["message"]
    assert message["content"] == "Let me check."
    assert [(c["function"]["name"], c["function"]["arguments"])
            for c in message["tool_calls"]] == [
        ("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"zone": "Europe/Paris"})]


async def test_responses_function_calls(phi4) -> None:
    resp = await phi4.post("/v1/responses", json={
        "input": "Weather in Paris?", "max_output_tokens": 300,
        "tools": [{"type": "function", **t["function"]} for t in (WEATHER, TIME)]})
    assert resp.status == 200, await resp.text()
    output = (await resp.json())["output"]
    calls = [item for item in output if item["type"] == "function_call"]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"zone": "Europe/Paris"})]
