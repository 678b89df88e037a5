"""Magistral / Ministral 3 Reasoning through the real routes, on recorded outputs: its real
template (tests/text/templates/mistralai-Ministral-3-14B-Reasoning-2512.jinja), a tokenizer
whose Tekken control tokens ([THINK], [/THINK], [TOOL_CALLS], [ARGS]) are special, and
`[THINK]...[/THINK]` reasoning shaped into each dialect's reasoning, streamed token by token
(the fake service sends one token a delta) and not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from strata.engine.api import create_app
from strata.engine.text import load_text_assets
from strata.engine.text.detokenizer import IncrementalDetokenizer

from .conftest import parse_sse
from .fake_service import FakeService
from .tiny_text import write_tiny_ministral_reasoning_dir

TEMPLATES = Path(__file__).parent.parent / "text" / "templates"

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
THOUGHT = "The user wants the weather."
# What the model writes after `[/INST]`: its reasoning, then a call right after [/THINK].
CALLING = f'[THINK]{THOUGHT}[/THINK][TOOL_CALLS]get_weather[ARGS]{{"city": "Paris"}}'
ANSWERING = f"[THINK]{THOUGHT}[/THINK]It is sunny."


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return load_text_assets(write_tiny_ministral_reasoning_dir(tmp_path_factory.mktemp("m3r")))


@pytest.fixture
def service(assets) -> FakeService:
    service = FakeService(assets, reply_text=CALLING)
    service.context_tokens = 4096
    return service


@pytest.fixture
async def client(aiohttp_client, service):
    return await aiohttp_client(create_app(service))


def test_the_parsers_see_the_control_tokens(assets, tmp_path) -> None:
    """[THINK] / [/THINK] and the call markers stay in the output text for the Reasoning
    template; an instruct Mistral template shows the call markers only."""
    shown = {assets.tokenizer.id_to_token(i) for i in assets.shown_special_ids}
    assert shown == {"[THINK]", "[/THINK]", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"}
    ids = assets.encode("[THINK]a[/THINK][TOOL_CALLS]f[ARGS]{}</s>", add_special=False)
    detokenizer = IncrementalDetokenizer(assets)
    text = "".join(detokenizer.push([i]) for i in ids) + detokenizer.flush()
    assert text == "[THINK]a[/THINK][TOOL_CALLS]f[ARGS]{}"
    instruct = load_text_assets(write_tiny_ministral_reasoning_dir(
        tmp_path, template=TEMPLATES / "mistral-small-3.2-instruct-2506.jinja"))
    assert {instruct.tokenizer.id_to_token(i) for i in instruct.shown_special_ids} == {
        "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"}


def _prompt(service) -> str:
    return service.text.decode(list(service.requests[-1].prompt_ids), skip_special=False)


async def test_openai_reasoning_then_call(client, service) -> None:
    body = {"messages": ASK, "tools": [WEATHER], "max_tokens": 200}
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status == 200, await resp.text()
    choice = (await resp.json())["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["reasoning_content"] == THOUGHT
    assert not message.get("content")
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert _prompt(service).endswith("Weather in Paris?[/INST]")

    resp = await client.post("/v1/chat/completions", json={**body, "stream": True})
    deltas = [d["choices"][0]["delta"] for _, d in parse_sse(await resp.text())
              if d != "[DONE]" and d["choices"]]
    reasoning = [d["reasoning_content"] for d in deltas if d.get("reasoning_content")]
    assert "".join(reasoning) == THOUGHT and len(reasoning) > 1  # streamed, token by token
    assert not "".join(d.get("content") or "" for d in deltas)
    calls = [c for d in deltas for c in d.get("tool_calls") or []]
    assert calls[0]["function"]["name"] == "get_weather"
    arguments = "".join(c["function"].get("arguments") or "" for c in calls)
    assert json.loads(arguments) == {"city": "Paris"}

    service.reply_text = "It is sunny."  # no think block: all of it is the answer
    resp = await client.post("/v1/chat/completions", json={**body, "stream": True})
    deltas = [d["choices"][0]["delta"] for _, d in parse_sse(await resp.text())
              if d != "[DONE]" and d["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == "It is sunny."
    assert not any(d.get("reasoning_content") for d in deltas)


async def test_anthropic_thinking_and_tool_use(client) -> None:
    resp = await client.post("/v1/messages", json={
        "model": "m", "max_tokens": 2000, "messages": ASK,
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "tools": [{"name": "get_weather", "description": "Weather of a city",
                   "input_schema": WEATHER["function"]["parameters"]}]})
    assert resp.status == 200, await resp.text()
    blocks = (await resp.json())["content"]
    assert [b["type"] for b in blocks] == ["thinking", "tool_use"]
    assert blocks[0]["thinking"] == THOUGHT
    assert blocks[1]["name"] == "get_weather" and blocks[1]["input"] == {"city": "Paris"}


async def test_anthropic_budget_closes_with_the_mistral_tag(client, service) -> None:
    """Cut at budget_tokens inside the block, Strata appends [/THINK] (one control token), not
    Qwen3's </think>, and the model answers in the same slot."""
    answers = {1: "[THINK]" + "hmm " * 1400 + "[/THINK]Too late."}
    service.reply_ids = lambda: [  # type: ignore[method-assign]
        *service.text.encode(answers.get(len(service.requests), "It is sunny."),
                             add_special=False), service.text.eos_token_ids[0]]
    resp = await client.post("/v1/messages", json={
        "model": "m", "max_tokens": 1500, "messages": ASK,
        "thinking": {"type": "enabled", "budget_tokens": 1024}})
    assert resp.status == 200, await resp.text()
    thinking, text = (await resp.json())["content"]
    assert thinking["thinking"].startswith("hmm") and "[/THINK]" not in thinking["thinking"]
    assert text == {"type": "text", "text": "It is sunny."}
    first, second = service.requests
    close_id = service.text.tokenizer.token_to_id("[/THINK]")
    assert list(second.prompt_ids[:len(first.prompt_ids)]) == list(first.prompt_ids)
    assert len(second.prompt_ids) == len(first.prompt_ids) + 1024 + 1
    assert second.prompt_ids[-1] == close_id


async def test_ollama_thinking(client, service) -> None:
    service.reply_text = ANSWERING
    resp = await client.post("/api/chat", json={"model": "tiny-test-model", "messages": ASK,
                                                 "stream": False, "think": True})
    assert resp.status == 200, await resp.text()
    message = (await resp.json())["message"]
    assert message["thinking"] == THOUGHT and message["content"] == "It is sunny."
    resp = await client.post("/api/chat", json={"model": "tiny-test-model", "messages": ASK})
    lines = [json.loads(line) for line in (await resp.text()).splitlines() if line]
    assert "".join(m["message"].get("thinking") or "" for m in lines) == THOUGHT
    assert "".join(m["message"]["content"] for m in lines) == "It is sunny."


async def test_responses_reasoning_item(client, service) -> None:
    service.reply_text = ANSWERING
    resp = await client.post("/v1/responses", json={"input": "Weather in Paris?"})
    assert resp.status == 200, await resp.text()
    output = (await resp.json())["output"]
    assert [item["type"] for item in output] == ["reasoning", "message"]
    assert output[0]["content"] == [{"type": "reasoning_text", "text": THOUGHT}]
    assert output[1]["content"][0]["text"] == "It is sunny."


async def test_reasoning_history_is_written_as_the_template_writes_it(client, service) -> None:
    """reasoning_content sent back (OpenAI), or a thinking block (Anthropic), reaches the
    template as its thinking content part: `[THINK]...[/THINK]` before the call."""
    service.reply_text = "It is sunny."
    history = [*ASK, {"role": "assistant", "content": "", "reasoning_content": THOUGHT,
                      "tool_calls": [{"id": "a1B2c3D4e", "type": "function", "function": {
                          "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "a1B2c3D4e", "content": "sunny"}]
    written = (f'[/INST][THINK]{THOUGHT}[/THINK][TOOL_CALLS]get_weather[ARGS]{{"city": '
               f'"Paris"}}</s>[TOOL_RESULTS]sunny[/TOOL_RESULTS]')
    resp = await client.post("/v1/chat/completions", json={
        "messages": history, "tools": [WEATHER], "max_tokens": 50})
    assert resp.status == 200, await resp.text()
    assert _prompt(service).endswith(written)
    shown = await (await client.post("/apply-template", json={
        "messages": history, "tools": [WEATHER]})).json()
    assert shown["prompt"].endswith(written)

    resp = await client.post("/v1/messages", json={"model": "m", "max_tokens": 50, "messages": [
        *ASK, {"role": "assistant", "content": [
            {"type": "thinking", "thinking": THOUGHT, "signature": ""},
            {"type": "text", "text": "Sunny."}]},
        {"role": "user", "content": "Thanks"}]})
    assert resp.status == 200, await resp.text()
    assert f"[/INST][THINK]{THOUGHT}[/THINK]Sunny.</s>[INST]Thanks[/INST]" in _prompt(service)


async def test_thinking_fields_follow_the_template(client) -> None:
    """The template always thinks and reads no switch or effort (as DeepSeek-R1's): asking
    for thinking is honoured, turning it off or setting an effort is a 400 naming the field."""
    for path, body in [("/v1/chat/completions", {"messages": ASK, "enable_thinking": True}),
                       ("/api/chat", {"model": "tiny-test-model", "messages": ASK,
                                      "think": True, "stream": False})]:
        resp = await client.post(path, json=body)
        assert resp.status == 200, await resp.text()
    for path, body, param in [
            ("/v1/chat/completions", {"messages": ASK, "enable_thinking": False},
             "enable_thinking"),
            ("/api/chat", {"model": "tiny-test-model", "messages": ASK, "think": False},
             "think"),
            ("/v1/chat/completions", {"messages": ASK, "reasoning_effort": "low"},
             "reasoning_effort"),
            ("/api/chat", {"model": "tiny-test-model", "messages": ASK, "think": "high"},
             "think"),
            ("/v1/responses", {"input": "hi", "reasoning": {"effort": "low"}}, "reasoning")]:
        resp = await client.post(path, json=body)
        assert resp.status == 400, (path, body, await resp.text())
        assert param in (await resp.text()), (path, body)


async def test_forced_call_and_prefill_skip_the_reasoning(client, service) -> None:
    """The model opens [THINK] itself, so a forced call (grammar from the first token) and a
    prefill are answers without reasoning, as before the split; asked to think too, a 400.
    (A guard that the split keeps what worked: these passed before it as well.)"""
    forced = {"type": "function", "function": {"name": "get_weather"}}
    service.reply_text = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
    resp = await client.post("/v1/chat/completions", json={
        "messages": ASK, "tools": [WEATHER], "tool_choice": forced, "max_tokens": 100})
    assert resp.status == 200, await resp.text()
    assert service.requests[-1].sampling.grammar is not None
    (call,) = (await resp.json())["choices"][0]["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    service.reply_text = " sunny."
    resp = await client.post("/v1/chat/completions", json={"max_tokens": 20, "messages": [
        *ASK, {"role": "assistant", "content": "It is"}]})
    assert resp.status == 200, await resp.text()
    assert (await resp.json())["choices"][0]["message"]["content"] == " sunny."
    assert _prompt(service).endswith("[/INST]It is")
    resp = await client.post("/v1/chat/completions", json={
        "messages": ASK, "tools": [WEATHER], "tool_choice": forced, "enable_thinking": True})
    assert resp.status == 400 and "enable_thinking" in await resp.text()
