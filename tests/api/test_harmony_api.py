"""A Harmony model (gpt-oss's real template and special tokens) through every API: its
analysis channel comes out as reasoning, final as content, commentary to=functions.X as
tool calls, on OpenAI chat (stream and not, real SDK), Responses (real SDK, tool loop
included), Anthropic messages (real SDK) and Ollama chat; the effort fields reach the
template, and are refused for a model whose template takes none."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

from strata.engine.api import create_app
from strata.engine.text import load_text_assets
from strata.engine.text.harmony import CLOSE_ANALYSIS

from .conftest import parse_sse
from .fake_service import FakeService
from .tiny_text import write_tiny_harmony_dir

REASONING = "The user wants the weather in Paris. Call get_weather."
ANALYSIS = f"<|channel|>analysis<|message|>{REASONING}<|end|>"
CALL = ("<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city": "Paris"}<|call|>')
ANSWER = "It is sunny in Paris."
FINAL = f"<|start|>assistant<|channel|>final<|message|>{ANSWER}"  # then <|return|> (EOS)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def harmony_assets(tmp_path_factory):
    return load_text_assets(write_tiny_harmony_dir(tmp_path_factory.mktemp("gpt-oss")))


@pytest.fixture
def service(harmony_assets) -> FakeService:
    return FakeService(harmony_assets, reply_text=ANALYSIS + CALL, context_tokens=65536,
                       model_id="gpt-oss-tiny")


@pytest.fixture
async def base_url(aiohttp_server, service):
    server = await aiohttp_server(create_app(service))
    return f"http://127.0.0.1:{server.port}"


def _prompt(service: FakeService, index: int = -1) -> str:
    return service.text.decode(list(service.requests[index].prompt_ids), skip_special=False)


async def test_openai_chat_reasoning_and_call_whole_and_streamed(base_url, service) -> None:
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="k", max_retries=0)
    chat = await client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER],
                                                reasoning_effort="low")
    message = chat.choices[0].message
    assert message.model_extra["reasoning_content"] == REASONING
    assert message.content in (None, "")
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] \
        == [("get_weather", {"city": "Paris"})]
    assert chat.choices[0].finish_reason == "tool_calls"
    prompt = _prompt(service)
    assert "Reasoning: low\n" in prompt and "type get_weather = (_: {" in prompt

    service.reply_text = ANALYSIS + FINAL
    stream = await client.chat.completions.create(model="m", messages=ASK, stream=True)
    reasoning, content = "", ""
    async for chunk in stream:
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is not None:
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            content += delta.content or ""
    assert (reasoning, content) == (REASONING, ANSWER)  # <|end|> did not stop it
    assert "Reasoning: medium\n" in _prompt(service)  # the template's default
    await client.close()


async def test_tool_result_goes_back_in_harmony(base_url, service) -> None:
    """The OpenAI tool loop's second turn: the call and its result rendered the Harmony way,
    the reasoning before the call kept (no final answer followed it yet)."""
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="k", max_retries=0)
    first = await client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER])
    call = first.choices[0].message.tool_calls[0]
    service.reply_text = ANALYSIS + FINAL
    history = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    second = await client.chat.completions.create(model="m", messages=history, tools=[WEATHER])
    assert second.choices[0].message.content == ANSWER
    prompt = _prompt(service)
    assert f"<|channel|>analysis<|message|>{REASONING}<|end|>" in prompt
    assert ('<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>'
            '{"city": "Paris"}<|call|><|start|>functions.get_weather to=assistant'
            '<|channel|>commentary<|message|>"sunny"<|end|><|start|>assistant') in prompt
    await client.close()


async def test_forced_tool_choice_prefills_the_call_header(client, service) -> None:
    service.reply_text = '{"city": "Oslo"}'  # what the grammar lets the model write
    response = await client.post("/v1/chat/completions", json={
        "messages": ASK, "tools": [WEATHER],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    assert response.status == 200, await response.text()
    message = (await response.json())["choices"][0]["message"]
    assert message["tool_calls"][0]["function"] == {"name": "get_weather",
                                                    "arguments": '{"city": "Oslo"}'}
    assert _prompt(service).endswith("<|start|>assistant<|channel|>commentary to=functions."
                                     "get_weather <|constrain|>json<|message|>")
    assert service.requests[-1].sampling.grammar is not None


async def test_responses_reasoning_items_and_tool_loop(base_url, service) -> None:
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="k", max_retries=0)
    tool = {"type": "function", "name": "get_weather", "description": "Weather of a city",
            "parameters": WEATHER["function"]["parameters"]}
    first = await client.responses.create(model="m", input="Weather in Paris?", tools=[tool],
                                          reasoning={"effort": "high"}, store=False)
    kinds = [item.type for item in first.output]
    assert kinds == ["reasoning", "function_call"]
    assert first.output[0].content[0].text == REASONING
    assert first.reasoning.effort == "high"
    assert "Reasoning: high\n" in _prompt(service)
    call = first.output[1]
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})

    # The loop as OpenAI documents it: the output items go back with the call's result.
    service.reply_text = ANALYSIS + FINAL
    stream = await client.responses.create(
        model="m", tools=[tool], stream=True, store=False,
        input=[{"role": "user", "content": "Weather in Paris?"},
               *[item.model_dump(exclude_none=True) for item in first.output],
               {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    events = [event async for event in stream]
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == REASONING
    final = events[-1].response
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output_text == ANSWER
    # The reasoning item sent back went to the template (kept: it led to the call).
    assert f"<|channel|>analysis<|message|>{REASONING}<|end|>" in _prompt(service)
    await client.close()


async def test_anthropic_thinking_blocks_and_tool_use(base_url, service) -> None:
    client = anthropic.AsyncAnthropic(base_url=base_url, api_key="k", max_retries=0)
    message = await client.messages.create(
        model="m", max_tokens=8000, messages=ASK, tools=[{
            "name": "get_weather", "description": "Weather of a city",
            "input_schema": WEATHER["function"]["parameters"]}],
        thinking={"type": "enabled", "budget_tokens": 2048})
    assert [block.type for block in message.content] == ["thinking", "tool_use"]
    assert message.content[0].thinking == REASONING
    assert message.content[1].input == {"city": "Paris"}
    assert message.stop_reason == "tool_use"
    assert "Reasoning: low\n" in _prompt(service)  # a 2048-token budget is low effort

    service.reply_text = ANALYSIS + FINAL
    async with client.messages.stream(model="m", max_tokens=30000, messages=ASK, thinking={
            "type": "enabled", "budget_tokens": 20000}) as stream:
        final = await stream.get_final_message()
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None))
            for b in final.content] == [("thinking", REASONING), ("text", ANSWER)]
    assert "Reasoning: high\n" in _prompt(service)
    await client.close()


async def test_ollama_chat_thinking_and_tool_calls(client, service) -> None:
    response = await client.post("/api/chat", json={
        "model": "gpt-oss-tiny", "messages": ASK, "tools": [WEATHER], "think": "high",
        "stream": False})
    assert response.status == 200, await response.text()
    message = (await response.json())["message"]
    assert message["thinking"] == REASONING
    assert message["tool_calls"][0]["function"]["name"] == "get_weather"
    assert message["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert "Reasoning: high\n" in _prompt(service)

    service.reply_text = ANALYSIS + FINAL
    response = await client.post("/api/chat", json={"model": "gpt-oss-tiny", "messages": ASK,
                                                     "think": True})
    lines = [json.loads(line) for line in (await response.text()).splitlines() if line]
    assert "".join(line["message"].get("thinking", "") for line in lines) == REASONING
    assert "".join(line["message"]["content"] for line in lines) == ANSWER
    show = await client.post("/api/show", json={"model": "gpt-oss-tiny"})
    assert "thinking" in (await show.json())["capabilities"]


@pytest.mark.parametrize(("route", "body", "param"), [
    ("/v1/chat/completions", {"messages": ASK, "enable_thinking": False}, "enable_thinking"),
    ("/v1/chat/completions", {"messages": ASK, "reasoning_effort": "max"}, "reasoning_effort"),
    ("/v1/chat/completions", {"messages": ASK, "chat_template_kwargs": {
        "builtin_tools": ["python"]}}, "chat_template_kwargs"),
    ("/api/chat", {"model": "gpt-oss-tiny", "messages": ASK, "think": False}, "think"),
    ("/api/chat", {"model": "gpt-oss-tiny", "messages": ASK, "think": "extreme"}, "think"),
    ("/v1/responses", {"input": "hi", "reasoning": {"summary": "auto"}}, "reasoning"),
    ("/v1/messages", {"messages": ASK, "max_tokens": 64, "thinking": {"type": "disabled"}},
     "thinking"),
])
async def test_what_a_harmony_model_cannot_do_is_a_400(client, route, body, param) -> None:
    response = await client.post(route, json=body)
    assert response.status == 400, await response.text()
    text = json.dumps(await response.json())
    assert param in text


@pytest.mark.parametrize(("route", "body", "param"), [
    ("/v1/chat/completions", {"messages": ASK, "reasoning_effort": "low"}, "reasoning_effort"),
    ("/api/chat", {"model": "tiny-test-model", "messages": ASK, "think": "low"}, "think"),
    ("/v1/responses", {"input": "hi", "reasoning": {"effort": "low"}}, "reasoning"),
])
async def test_effort_on_a_template_without_it_is_a_400(aiohttp_client, text_assets, route,
                                                        body, param) -> None:
    """The ChatML tiny model's template takes no effort: refused, naming the field."""
    plain = FakeService(text_assets)
    client = await aiohttp_client(create_app(plain))
    response = await client.post(route, json=body)
    assert response.status == 400, await response.text()
    assert param in json.dumps(await response.json()) and "effort" in await response.text()
    assert not plain.requests


async def test_sse_chunks_carry_no_harmony_markers(client, service) -> None:
    service.reply_text = ANALYSIS + FINAL
    response = await client.post("/v1/chat/completions", json={"messages": ASK, "stream": True})
    body = await response.text()
    assert "<|" not in body
    chunks = [data for _, data in parse_sse(body) if data != "[DONE]"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


async def test_apply_template_shows_the_prompt_chat_would_feed(client, service) -> None:
    response = await client.post("/apply-template", json={
        "messages": ASK, "tools": [WEATHER], "tool_choice": "required",
        "reasoning_effort": "high"})
    assert response.status == 200, await response.text()
    prompt = (await response.json())["prompt"]
    assert "Reasoning: high\n" in prompt
    assert prompt.endswith("<|start|>assistant<|channel|>commentary to=functions.get_weather "
                           "<|constrain|>json<|message|>")  # one tool: its whole header


async def test_response_format_answers_in_the_final_channel(client, service) -> None:
    service.reply_text = '{"answer": 42}'
    response = await client.post("/v1/chat/completions", json={
        "messages": ASK, "response_format": {"type": "json_object"}})
    assert response.status == 200, await response.text()
    message = (await response.json())["choices"][0]["message"]
    assert message["content"] == '{"answer": 42}' and "reasoning_content" not in message
    assert _prompt(service).endswith("<|start|>assistant<|channel|>final<|message|>")
    assert service.requests[-1].sampling.grammar is not None


async def test_forced_choice_among_several_tools_names_them_in_the_grammar(client, service
                                                                           ) -> None:
    other = {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {}}}}
    service.reply_text = 'get_time <|constrain|>json<|message|>{}'
    response = await client.post("/v1/chat/completions", json={
        "messages": ASK, "tools": [WEATHER, other], "tool_choice": "required"})
    assert response.status == 200, await response.text()
    calls = (await response.json())["choices"][0]["message"]["tool_calls"]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("get_time", "{}")]
    assert _prompt(service).endswith("<|channel|>commentary to=functions.")
    grammar = service.requests[-1].sampling.grammar
    assert '"get_weather " <|constrain|> "json" <|message|>' in grammar
    assert '"get_time " <|constrain|> "json" <|message|>' in grammar


async def test_anthropic_budget_ends_the_analysis(client, service) -> None:
    """Past budget_tokens, Strata ends the analysis message and opens the final one itself
    (in the same slot), and the model answers with what is left of max_tokens."""
    answers = {1: "<|channel|>analysis<|message|>" + "hmm " * 1400}
    service.reply_ids = lambda: [  # type: ignore[method-assign]
        *service.text.encode(answers.get(len(service.requests), "Hello!"), add_special=False),
        service.text.eos_token_ids[0]]
    response = await client.post("/v1/messages", json={
        "model": "m", "max_tokens": 1500, "messages": ASK,
        "thinking": {"type": "enabled", "budget_tokens": 1024}})
    assert response.status == 200, await response.text()
    thinking, text = (await response.json())["content"]
    assert thinking["thinking"].startswith("hmm hmm") and "<|" not in thinking["thinking"]
    assert text == {"type": "text", "text": "Hello!"}
    first, second = service.requests
    assert first.sampling.max_tokens == 1024
    close = service.text.encode(CLOSE_ANALYSIS, add_special=False)
    assert list(second.prompt_ids) == [*first.prompt_ids,
                                       *service.text.encode(answers[1], add_special=False)
                                       [:1024], *close]
