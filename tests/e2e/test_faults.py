"""Faults on the real server: the engine process killed mid-stream, a client gone mid-stream."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from helpers.processes import KILLED_WORDS, kill_hard

from tests.e2e.server import ServerProcess
from tests.e2e.sse import chunk_text, sse_events

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
STORY = [{"role": "user", "content": "Write a long story about a dragon who learns to fly."}]
STORY_MAX_TOKENS = 400  # far more than the test ever reads: the stream is cut long before
TIMEOUT = aiohttp.ClientTimeout(total=120)


def chat_body(messages: list[dict], *, stream: bool, max_tokens: int = 48) -> dict:
    return {"messages": messages, "temperature": 0, "max_tokens": max_tokens, "stream": stream}


async def ask(base_url: str) -> dict:
    """The France question, not streamed; the whole JSON answer."""
    async with (aiohttp.ClientSession(timeout=TIMEOUT) as session,
                session.post(f"{base_url}/v1/chat/completions",
                             json=chat_body(QUESTION, stream=False)) as r):
        assert r.status == 200, await r.text()
        return await r.json()


@pytest.fixture(scope="module")
def reference_answer(server: ServerProcess) -> str:
    """The greedy answer of a healthy server, before any fault."""
    answer = asyncio.run(ask(server.base_url))["choices"][0]["message"]["content"]
    assert "Paris" in answer
    return answer


async def test_engine_killed_mid_stream_gives_an_error_event_then_recovers(
    server: ServerProcess, reference_answer: str
) -> None:
    before = server.status()
    old_pid = before["engine_pid"]
    assert old_pid
    events, pieces, is_killed = [], [], False
    async with (aiohttp.ClientSession(timeout=TIMEOUT) as session,
                session.post(f"{server.base_url}/v1/chat/completions",
                             json=chat_body(STORY, stream=True, max_tokens=STORY_MAX_TOKENS)) as r):
        assert r.status == 200
        async for _, data in sse_events(r):
            events.append(data)
            pieces.append(chunk_text(data))
            if not is_killed and sum(1 for p in pieces if p) >= 2:
                kill_hard(old_pid)  # the engine, as a driver fault would
                is_killed = True
    assert is_killed, f"the stream ended before two pieces arrived: {events}"
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    assert len(errors) == 1, events[-3:]
    error = errors[0]["error"]
    assert error["code"] == "engine_crashed" and KILLED_WORDS in error["message"], error
    assert events[-1] == "[DONE]" and events[-2] is errors[0]
    # No chunk claimed a normal end: the client knows the answer is cut short.
    assert not any(isinstance(e, dict) and e.get("choices")
                   and e["choices"][0].get("finish_reason") for e in events)

    # The next request restarts the engine (a first crash restarts at once) and is answered.
    answer = await ask(server.base_url)
    assert answer["choices"][0]["message"]["content"] == reference_answer
    after = server.status()
    assert after["state"] == "loaded"
    assert after["engine_pid"] not in (None, old_pid)
    assert after["engine_crashes"] == before["engine_crashes"] + 1
    assert after["engine_starts"] == before["engine_starts"] + 1


async def test_client_gone_mid_stream_cancels_and_the_next_request_is_unaffected(
    server: ServerProcess, reference_answer: str
) -> None:
    before = server.wait_idle()["counters"]
    num_pieces = 0
    async with (aiohttp.ClientSession(timeout=TIMEOUT) as session,
                session.post(f"{server.base_url}/v1/chat/completions",
                             json=chat_body(STORY, stream=True, max_tokens=STORY_MAX_TOKENS)) as r):
        assert r.status == 200
        async for _, data in sse_events(r):
            num_pieces += bool(chunk_text(data))
            if num_pieces >= 2:
                break
        r.close()  # drop the connection mid-stream, as a closed browser tab does
    status = server.wait_idle()
    assert not status["is_busy"], "the cancelled generation is still running"
    after = status["counters"]
    cancelled = after["finish_reasons"].get("cancelled", 0)
    assert cancelled == before["finish_reasons"].get("cancelled", 0) + 1, after
    # Counted in tokens, not seconds: it stopped far short of what it was allowed.
    num_generated = after["completion_tokens_total"] - before["completion_tokens_total"]
    assert 2 <= num_generated < STORY_MAX_TOKENS // 2, after

    # Same slot, next request: the cut history must not leak into it.
    answer = await ask(server.base_url)
    assert answer["choices"][0]["message"]["content"] == reference_answer
    # The chat template's system turn is shared with the story prompt, so it came from cache.
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert server.status()["engine_pid"] == status["engine_pid"]  # no restart was needed
