"""A real `strata serve` on a tiny ministral3 model with Ministral 3 Reasoning's real template
and Tekken-style special tokens: the official openai SDK streams `[THINK]` reasoning as
reasoning_content, reads the `[TOOL_CALLS]` call after `[/THINK]`, and sends the reasoning
back in the tool loop the way the template writes it.

The weights are built so the greedy next token depends on the last token alone
(save_scripted_hf_model): after `[/INST]` the model writes its reasoning and a call, after
`[/TOOL_RESULTS]` a plain answer with no think block. Engine, detokenizer, HTTP server and
SDK are all real; only what the model says is fixed.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator

import httpx
import openai
import pytest

from strata.engine.text import load_text_assets
from tests.api.tiny_text import write_tiny_ministral_reasoning_dir
from tests.e2e.server import ServerProcess
from tests.helpers.tiny_models import save_scripted_hf_model

THOUGHT, ARGUMENTS, ANSWER = ("The user wants the weather.", '{"city": "Paris"}',
                              "It is sunny in Paris.")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
SYSTEM = {"role": "system", "content": "Think, then answer."}


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[ServerProcess]:
    directory = tmp_path_factory.mktemp("tiny-ministral3-reasoning")
    write_tiny_ministral_reasoning_dir(directory,
                                       words=(THOUGHT, ARGUMENTS, ANSWER, "get_weather"))
    tokenizer = load_text_assets(directory).tokenizer
    script = [["[/INST]", "[THINK]", THOUGHT, "[/THINK]", "[TOOL_CALLS]", "get_weather",
               "[ARGS]", ARGUMENTS, "</s>"], ["[/TOOL_RESULTS]", ANSWER, "</s>"]]
    next_token = {tokenizer.token_to_id(a): tokenizer.token_to_id(b)
                  for line in script for a, b in itertools.pairwise(line)}
    assert None not in next_token and None not in next_token.values()
    save_scripted_hf_model("ministral3", directory, next_token,
                           tokenizer.get_vocab_size(with_added_tokens=True))
    with ServerProcess(tmp_path_factory.mktemp("serve-ministral3"),
                       ("--model", str(directory))).running() as process:
        yield process


async def test_openai_sdk_streams_reasoning_then_a_call_and_sends_it_back(
        server: ServerProcess) -> None:
    client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused",
                                max_retries=0, timeout=300)
    messages: list = [SYSTEM, {"role": "user", "content": "Weather in Paris?"}]
    stream = await client.chat.completions.create(
        model="default", messages=messages, tools=[WEATHER], max_tokens=32, temperature=0,
        stream=True)
    reasoning, content, calls, finish = [], [], {}, None
    async for chunk in stream:
        if not chunk.choices:
            continue
        delta, finish = chunk.choices[0].delta, chunk.choices[0].finish_reason or finish
        if getattr(delta, "reasoning_content", None):
            reasoning.append(delta.reasoning_content)
        content.append(delta.content or "")
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"id": call.id, "name": "", "arguments": ""})
            entry["name"] += call.function.name or ""
            entry["arguments"] += call.function.arguments or ""
    assert "".join(reasoning) == THOUGHT
    assert "".join(content) == "" and finish == "tool_calls"
    (call,) = calls.values()
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris"}

    messages += [{"role": "assistant", "content": None, "reasoning_content": THOUGHT,
                  "tool_calls": [{"id": call["id"], "type": "function", "function": {
                      "name": call["name"], "arguments": call["arguments"]}}]},
                 {"role": "tool", "tool_call_id": call["id"], "content": "sunny"}]
    second = await client.chat.completions.create(
        model="default", messages=messages, tools=[WEATHER], max_tokens=16, temperature=0)
    message = second.choices[0].message
    # No think block this time: all of it is the answer.
    assert message.content == ANSWER and not getattr(message, "reasoning_content", None)
    async with httpx.AsyncClient(timeout=60) as http:
        prompt = (await http.post(f"{server.base_url}/apply-template", json={
            "messages": messages, "tools": [WEATHER]})).json()["prompt"]
    assert prompt.endswith(f"[THINK]{THOUGHT}[/THINK][TOOL_CALLS]get_weather[ARGS]"
                           f"{ARGUMENTS}</s>[TOOL_RESULTS]sunny[/TOOL_RESULTS]")
