"""A real `strata serve` on a tiny random model that speaks through gpt-oss's tokenizer
shape and real Harmony template: the official openai SDK's tool loop with a forced call.

The weights are random (a Llama-shaped stand-in until the gpt-oss architecture lands), so only
a forced call is meaningful: the prompt ends with the call's Harmony header and the engine's
grammar (llguidance over this tokenizer) makes the arguments valid JSON of the tool's schema.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.api.tiny_text import write_tiny_harmony_dir
from tests.e2e.server import ServerProcess
from tests.helpers.tiny_models import make_tiny_hf_config

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[ServerProcess]:
    import torch
    import transformers

    directory = tmp_path_factory.mktemp("tiny-gpt-oss-shaped")
    config = make_tiny_hf_config("llama")
    config.vocab_size = 400  # the tiny Harmony tokenizer's size
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory)
    write_tiny_harmony_dir(directory)  # tokenizer, real template, end ids
    with ServerProcess(tmp_path_factory.mktemp("serve-harmony"),
                       ("--model", str(directory))).running() as process:
        yield process


async def test_openai_sdk_tool_loop_with_a_forced_call(server: ServerProcess) -> None:
    client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused",
                                max_retries=0, timeout=300)
    messages: list = [{"role": "user", "content": "Weather in Paris?"}]
    first = await client.chat.completions.create(
        model="default", messages=messages, tools=[WEATHER], max_tokens=48, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        reasoning_effort="low")
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls", first
    (call,) = message.tool_calls
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)  # the grammar made it valid JSON
    assert set(arguments) == {"city"} and isinstance(arguments["city"], str)

    messages += [message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    second = await client.chat.completions.create(
        model="default", messages=messages, tools=[WEATHER], max_tokens=8, temperature=0)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    async with httpx.AsyncClient(timeout=60) as http:
        prompt = (await http.post(f"{server.base_url}/apply-template", json={
            "messages": messages, "tools": [WEATHER]})).json()["prompt"]
        forced = (await http.post(f"{server.base_url}/apply-template", json={
            "messages": messages[:1], "tools": [WEATHER], "reasoning_effort": "low",
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})).json()
    # The first request's prompt: effort in the system message, the call's header at the end.
    assert "Reasoning: low\n" in forced["prompt"]
    assert forced["prompt"].endswith("<|start|>assistant<|channel|>commentary "
                                     "to=functions.get_weather <|constrain|>json<|message|>")
    assert (f"<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
            f"{json.dumps(arguments, ensure_ascii=False)}<|call|><|start|>functions.get_weather to=assistant"
            '<|channel|>commentary<|message|>"sunny"<|end|><|start|>assistant') in prompt
    await client.close()


async def test_required_choice_among_two_tools(server: ServerProcess) -> None:
    """With two tools to choose from, the grammar writes the name and the rest of the header
    (as text the parser reads like the special tokens), then that tool's arguments."""
    clock = {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
        "required": ["zone"], "additionalProperties": False}}}
    client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused",
                                max_retries=0, timeout=300)
    chat = await client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Weather or time?"}],
        tools=[WEATHER, clock], tool_choice="required", max_tokens=64, temperature=0)
    assert chat.choices[0].finish_reason == "tool_calls", chat
    (call,) = chat.choices[0].message.tool_calls
    arguments = json.loads(call.function.arguments)
    if call.function.name == "get_time":
        assert arguments["zone"] in ("UTC", "CET")
    else:
        assert call.function.name == "get_weather" and set(arguments) == {"city"}
    assert not chat.choices[0].message.content
    await client.close()


async def test_response_format_is_the_final_message(server: ServerProcess) -> None:
    client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused",
                                max_retries=0, timeout=300)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    chat = await client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Fine?"}], max_tokens=32,
        temperature=0, response_format={"type": "json_schema", "json_schema": {
            "name": "answer", "schema": schema}})
    message = chat.choices[0].message
    assert isinstance(json.loads(message.content)["ok"], bool)
    assert not (message.model_extra or {}).get("reasoning_content")
    await client.close()
