"""Real client libraries against the real `strata serve` (default model, engine process) where
they used to break (issue 51): assistant prefill with the anthropic and openai SDKs, the
anthropic SDK's tool_runner and its `thread` fallback, and Ollama's timings with the ollama
client."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from typing import Any

import anthropic
import ollama
import openai
import pytest

from tests.e2e.server import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MODEL = "SmolLM2-135M-Instruct.Q4_1"
QUESTION = {"role": "user", "content": "List three fruits."}
PREFILL = "1. Apple\n2."
MAX_TOKENS = 16


def post_json(server: ServerProcess, path: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(server.base_url + path, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


@pytest.fixture(scope="module")
def continuation(server: ServerProcess) -> str:
    """The greedy continuation of the prompt that ends inside the prefilled assistant turn:
    the conversation before it with the generation prompt, then the prefill, as raw text."""
    prompt = post_json(server, "/apply-template", {"messages": [QUESTION]})["prompt"]
    done = post_json(server, "/v1/completions", {
        "model": MODEL, "prompt": prompt + PREFILL, "max_tokens": MAX_TOKENS,
        "temperature": 0})
    text = done["choices"][0]["text"]
    answer_anew = post_json(server, "/v1/chat/completions", {
        "model": MODEL, "messages": [QUESTION], "max_tokens": MAX_TOKENS, "temperature": 0})
    # Else the test could not tell a continuation from a fresh answer.
    assert text and text != answer_anew["choices"][0]["message"]["content"]
    return text


@pytest.fixture(scope="module")
def claude(server: ServerProcess) -> anthropic.Anthropic:
    client = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0,
                                 timeout=120)
    yield client
    client.close()


def test_anthropic_sdk_continues_a_prefilled_assistant_turn(claude, continuation):
    messages = [QUESTION, {"role": "assistant", "content": PREFILL}]
    message = claude.messages.create(model=MODEL, max_tokens=MAX_TOKENS, messages=messages,
                                     extra_body={"temperature": 0})
    # As Anthropic answers: only the continuation, not the prefill again.
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == continuation
    with claude.messages.stream(model=MODEL, max_tokens=MAX_TOKENS, messages=messages,
                                extra_body={"temperature": 0}) as stream:
        streamed = "".join(stream.text_stream)
    assert streamed == continuation


def test_openai_sdk_continues_a_prefilled_assistant_turn(server, continuation):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0,
                           timeout=120)
    reply = client.chat.completions.create(
        model=MODEL, messages=[QUESTION, {"role": "assistant", "content": PREFILL}],
        max_tokens=MAX_TOKENS, temperature=0)
    client.close()
    assert reply.choices[0].message.content == continuation


def test_a_prefill_with_a_json_schema_is_a_400_naming_messages(claude):
    with pytest.raises(anthropic.BadRequestError, match="prefill"):
        claude.messages.create(
            model=MODEL, max_tokens=MAX_TOKENS,
            messages=[QUESTION, {"role": "assistant", "content": "{"}],
            extra_body={"output_config": {"format": {
                "type": "json_schema", "schema": {"type": "object"}}}})


def test_anthropic_tool_runner_falls_back_from_thread_and_runs_the_tool(claude):
    calls: list[str] = []

    @anthropic.beta_tool
    def get_weather(city: str) -> str:
        """The weather in a city.

        Args:
            city: the city's name
        """
        calls.append(city)
        return f"Sunny in {city}"

    # The runner sends `thread` first; only error.details.error_code
    # "thread_unsupported_request" makes it resend the history without one.
    runner = claude.beta.messages.tool_runner(
        model=MODEL, max_tokens=64, tools=[get_weather], max_iterations=2,
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    replies = list(runner)
    assert len(replies) == 2
    assert [block.type for block in replies[0].content] == ["tool_use"]
    assert len(calls) >= 1 and all(isinstance(city, str) for city in calls)


def test_a_thread_is_refused_in_the_shape_the_anthropic_sdk_reads(claude):
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(model=MODEL, max_tokens=8, messages=[QUESTION],
                               extra_body={"thread": {"type": "new"}})
    assert caught.value.body["error"]["details"] == {"error_code": "thread_unsupported_request"}


def _check_timings(answer: Any) -> None:
    """Ollama's durations (ns), which clients divide the counts by."""
    assert answer.eval_count > 1 and answer.prompt_eval_count > 10
    assert answer.prompt_eval_duration > 0 and answer.eval_duration > 0
    assert answer.load_duration >= 0
    parts_ns = answer.load_duration + answer.prompt_eval_duration + answer.eval_duration
    assert parts_ns <= answer.total_duration, answer


def test_ollama_client_gets_real_timings_whole_and_streamed(server):
    client = ollama.Client(host=server.base_url, timeout=120)
    options = {"num_predict": 12, "temperature": 0}
    messages = [{"role": "user", "content": "Tell me about Paris."}]
    _check_timings(client.chat(model=MODEL, messages=messages, options=options))
    *_, last = client.chat(model=MODEL, messages=messages, options=options, stream=True)
    assert last.done
    _check_timings(last)
    _check_timings(client.generate(model=MODEL, prompt="Tell me about Rome.",
                                   options=options))


def test_ollama_load_duration_is_the_load_a_request_waited_for(server):
    client = ollama.Client(host=server.base_url, timeout=120)
    post_json(server, "/unload", {})
    answer = client.chat(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                         options={"num_predict": 4, "temperature": 0})
    _check_timings(answer)
    # The engine process started and loaded the weights for this request.
    assert answer.load_duration > answer.prompt_eval_duration


async def test_four_parallel_streams_interleave_on_the_cpu(server):
    # The default settings (4 slots, parallel one per slot) batch on the CPU too: each stream
    # has tokens before any of the four ends (asserted by event order, never by timings).
    client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused",
                                max_retries=0, timeout=300)
    order: list[tuple[int, str]] = []  # (stream, "token" | "end") in arrival order

    async def stream(index: int, question: str) -> None:
        chunks = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=12,
            temperature=0, stream=True)
        async for chunk in chunks:
            if chunk.choices and chunk.choices[0].delta.content:
                order.append((index, "token"))
        order.append((index, "end"))

    questions = ("Tell me about Paris.", "Tell me about Rome.", "Tell me about Oslo.",
                 "Tell me about Lima.")
    await asyncio.gather(*(stream(i, q) for i, q in enumerate(questions)))
    await client.close()
    first_end = next(n for n, (_, kind) in enumerate(order) if kind == "end")
    assert {index for index, _ in order[:first_end]} == {0, 1, 2, 3}, order
