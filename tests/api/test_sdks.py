"""The official openai and anthropic SDKs, unchanged, against the app on a real port."""

from __future__ import annotations

import anthropic
import openai
import pytest

from strata.engine.api import create_app


@pytest.fixture
async def base_url(aiohttp_server, service):
    server = await aiohttp_server(create_app(service, api_key="k"))
    return f"http://127.0.0.1:{server.port}"


async def test_openai_sdk(base_url, service):
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="k", max_retries=0)
    models = await client.models.list()
    assert [m.id for m in models.data] == ["tiny-test-model"]
    messages = [{"role": "user", "content": "What is the answer?"}]
    chat = await client.chat.completions.create(model="m", messages=messages, max_tokens=64)
    assert chat.choices[0].message.content == service.reply_text
    assert chat.choices[0].finish_reason == "stop"
    assert chat.usage.prompt_tokens_details.cached_tokens == 3
    stream = await client.chat.completions.create(
        model="m", messages=messages, stream=True, stream_options={"include_usage": True},
        stop=["42"])
    pieces, usage = [], None
    async for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
        usage = chunk.usage or usage
    assert "".join(pieces) == "Hello world! The answer is "
    assert usage is not None and usage.completion_tokens > 0
    done = await client.completions.create(model="m", prompt="The quick", max_tokens=3)
    assert done.choices[0].finish_reason == "length"
    assert done.usage.completion_tokens == 3
    with pytest.raises(openai.BadRequestError, match="'temperature' is 5"):
        await client.chat.completions.create(model="m", messages=messages, temperature=5)
    await client.close()


async def test_openai_sdk_raises_on_a_stream_that_fails(base_url, service):
    service.fail_after = 2
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="k", max_retries=0)
    stream = await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], stream=True)
    with pytest.raises(openai.APIError, match="fell over"):
        async for _ in stream:
            pass
    await client.close()


async def test_anthropic_sdk(base_url, service):
    client = anthropic.AsyncAnthropic(base_url=base_url, api_key="k", max_retries=0)
    messages = [{"role": "user", "content": "What is the answer?"}]
    message = await client.messages.create(model="m", max_tokens=64, system="Be brief.",
                                           messages=messages)
    assert message.content[0].text == service.reply_text
    assert message.stop_reason == "end_turn"
    async with client.messages.stream(model="m", max_tokens=64, messages=messages,
                                      stop_sequences=["answer"]) as stream:
        text = "".join([piece async for piece in stream.text_stream])
        final = await stream.get_final_message()
    assert text == "Hello world! The "
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == "answer"
    count = await client.messages.count_tokens(model="m", messages=messages)
    assert count.input_tokens > 0
    with pytest.raises(anthropic.BadRequestError, match=r"'temperature' is 1.5"):
        await client.messages.create(model="m", max_tokens=5, messages=messages,
                                     extra_body={"temperature": 1.5})
    await client.close()
