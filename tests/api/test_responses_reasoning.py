"""Responses reasoning items from a `<think>` model (Qwen3's real template): the reasoning is
a `reasoning` output item, no longer left in the message text, whole and streamed."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from strata.engine.api import create_app

from .conftest import parse_sse
from .fake_service import FakeService

QWEN3 = Path(__file__).parent.parent / "text" / "templates" / "qwen3.jinja"


@pytest.fixture
def service(text_assets) -> FakeService:
    assets = dataclasses.replace(text_assets, chat_template=QWEN3.read_text())
    return FakeService(assets, reply_text="<think>\nThe answer is 42.\n</think>\n\nHello world!")


@pytest.fixture
async def client(aiohttp_client, service):
    return await aiohttp_client(create_app(service))


async def test_reasoning_item_before_the_message(client) -> None:
    response = await client.post("/v1/responses", json={"input": "hi"})
    assert response.status == 200, await response.text()
    output = (await response.json())["output"]
    assert [item["type"] for item in output] == ["reasoning", "message"]
    assert output[0]["content"] == [{"type": "reasoning_text", "text": "The answer is 42."}]
    assert output[1]["content"][0]["text"] == "Hello world!"


async def test_reasoning_item_streamed(client) -> None:
    response = await client.post("/v1/responses", json={"input": "hi", "stream": True})
    events = [data for _, data in parse_sse(await response.text())]
    kinds = [e["type"] for e in events]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert deltas == "The answer is 42."
    final = events[-1]["response"]
    assert [item["type"] for item in final["output"]] == ["reasoning", "message"]
    assert final["output"][1]["content"][0]["text"] == "Hello world!"


async def test_a_reasoning_item_sent_back_reaches_the_template(client, service) -> None:
    response = await client.post("/v1/responses", json={"input": [
        {"role": "user", "content": "hi"},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "Earlier thought."}]},
        # A call and its result: a history ending in an assistant message would be a prefill
        # to continue, and Qwen3 keeps reasoning only after the last user turn.
        {"type": "function_call", "call_id": "call_1", "name": "lookup", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "42"}]})
    assert response.status == 200, await response.text()
    prompt = service.text.decode(list(service.requests[-1].prompt_ids), skip_special=False)
    assert "<think>\nEarlier thought.\n</think>" in prompt  # Qwen3 keeps the last turn's
