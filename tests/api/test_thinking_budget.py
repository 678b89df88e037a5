"""Anthropic thinking.budget_tokens is enforced: past the budget the think block is closed by
the server and the model answers in the same slot with what is left of max_tokens."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from strata.engine.api import create_app
from strata.engine.api.thinking_budget import CLOSE_TEXT

from .conftest import parse_sse

TEMPLATES = Path(__file__).parent.parent / "text" / "templates"
BUDGET, MAX_TOKENS = 1024, 1500
LONG_THOUGHT = "<think>\n" + "hmm " * 1400 + "</think>\n\nToo late."


@pytest.fixture
async def client(aiohttp_client, service):
    service.text = dataclasses.replace(service.text,
                                       chat_template=(TEMPLATES / "qwen3.jinja").read_text())
    service.context_tokens = 8192
    answers = {1: LONG_THOUGHT}  # the first part thinks past the budget; the second answers
    service.reply_ids = lambda: [  # type: ignore[method-assign]
        *service.text.encode(answers.get(len(service.requests), "Hello!"), add_special=False),
        service.text.eos_token_ids[0]]
    return await aiohttp_client(create_app(service))


BODY = {"model": "m", "max_tokens": MAX_TOKENS, "messages": [{"role": "user", "content": "Hi"}],
        "thinking": {"type": "enabled", "budget_tokens": BUDGET}}


async def test_the_think_block_is_closed_at_the_budget(client, service):
    answer = await (await client.post("/v1/messages", json=BODY)).json()
    thinking, text = answer["content"]
    assert thinking["type"] == "thinking" and text == {"type": "text", "text": "Hello!"}
    first, second = service.requests
    assert first.sampling.max_tokens == BUDGET
    close_ids = service.text.encode(CLOSE_TEXT, add_special=False)
    # The second part extends the first's prompt and tokens, then the closing tag: the same
    # slot reuses all of it, and only what is left of max_tokens remains.
    assert second.prompt_ids[:len(first.prompt_ids)] == first.prompt_ids
    assert list(second.prompt_ids[-len(close_ids):]) == close_ids
    assert len(second.prompt_ids) == len(first.prompt_ids) + BUDGET + len(close_ids)
    assert second.sampling.max_tokens == MAX_TOKENS - BUDGET - len(close_ids)
    assert second.slot == first.slot
    num_answer = len(service.text.encode("Hello!", add_special=False)) + 1  # and the end token
    assert answer["usage"]["output_tokens"] == BUDGET + num_answer
    assert "</think>" not in thinking["thinking"] and thinking["thinking"].startswith("hmm")


async def test_streamed_too(client, service):
    events = parse_sse(await (await client.post("/v1/messages",
                                                json={**BODY, "stream": True})).text())
    starts = [d["content_block"]["type"] for n, d in events if n == "content_block_start"]
    assert starts == ["thinking", "text"]
    text = "".join(d["delta"].get("text", "") for n, d in events if n == "content_block_delta")
    assert text == "Hello!"
    assert len(service.requests) == 2


async def test_thinking_within_the_budget_runs_once(client, service):
    service.reply_ids = lambda: [  # type: ignore[method-assign]
        *service.text.encode("<think>\nShort.\n</think>\n\nHi!", add_special=False),
        service.text.eos_token_ids[0]]
    answer = await (await client.post("/v1/messages", json=BODY)).json()
    assert [b["type"] for b in answer["content"]] == ["thinking", "text"]
    assert answer["content"][1]["text"] == "Hi!" and len(service.requests) == 1
