"""32 concurrent streaming clients, 96 requests: none lost, none mixed with another's tokens.

Every prompt starts with a different token, so no request reuses another's cached prefix and
each greedy answer is computed exactly as in the sequential run: any difference is a bug
(tokens routed to the wrong stream, dropped or duplicated), never float noise.
"""

from __future__ import annotations

import asyncio
import random

import aiohttp
import pytest

from tests.e2e.server import ServerProcess
from tests.e2e.sse import chunk_text, sse_events

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

NUM_REQUESTS = 96  # three per client: every client comes back to the queue
NUM_CLIENTS = 32
MAX_TOKENS = 2  # two tokens per stream show mixing; more would not fit two busy cores
REQUEST_TIMEOUT = aiohttp.ClientTimeout(total=180)


async def distinct_first_token_prompts(session: aiohttp.ClientSession, base_url: str,
                                       count: int) -> list[str]:
    """`count` prompts whose first tokens all differ: capitalised words from the vocabulary."""
    prompts, first_ids = [], set()
    for token_id in range(2000, 49000, 37):
        async with session.post(f"{base_url}/detokenize", json={"tokens": [token_id]}) as r:
            word = (await r.json())["content"]
        if not (word.isascii() and word.isalpha() and len(word) >= 3):
            continue
        prompt = f"{word.capitalize()} is a word. In a sentence:"
        async with session.post(f"{base_url}/tokenize", json={"content": prompt}) as r:
            first = (await r.json())["tokens"][0]
        if first not in first_ids:
            first_ids.add(first)
            prompts.append(prompt)
        if len(prompts) == count:
            return prompts
    raise AssertionError(f"only {len(prompts)} prompts with distinct first tokens found")


def completion_body(prompt: str, stream: bool) -> dict:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def sequential_answers(session: aiohttp.ClientSession, base_url: str,
                             prompts: list[str]) -> list[tuple[str, int]]:
    """(text, completion tokens) of each prompt, one request at a time, not streamed."""
    answers = []
    for prompt in prompts:
        async with session.post(f"{base_url}/v1/completions",
                                json=completion_body(prompt, stream=False)) as r:
            assert r.status == 200, await r.text()
            body = await r.json()
        answers.append((body["choices"][0]["text"], body["usage"]["completion_tokens"]))
    return answers


async def stream_one(session: aiohttp.ClientSession, base_url: str, prompt: str) -> dict:
    """One streamed completion: its text and usage, or how it was refused or broke."""
    async with session.post(f"{base_url}/v1/completions",
                            json=completion_body(prompt, stream=True)) as r:
        if r.status != 200:  # a clean refusal is a JSON error before any stream
            return {"outcome": "refused", "status": r.status, "body": await r.json()}
        ids, pieces, finish_reasons, usage, is_done = set(), [], [], None, False
        async for _, data in sse_events(r):
            if data == "[DONE]":
                is_done = True
                continue
            if "error" in data:
                return {"outcome": "error", "body": data}
            ids.add(data["id"])
            pieces.append(chunk_text(data))
            if data["choices"]:
                finish_reasons.append(data["choices"][0]["finish_reason"])
            usage = data.get("usage") or usage
    return {"outcome": "ok", "text": "".join(pieces), "ids": ids, "usage": usage,
            "finish_reason": finish_reasons[-1] if finish_reasons else None, "done": is_done}


async def client(base_url: str, queue: asyncio.Queue, results: dict) -> None:
    """One client with its own connection, sending requests until the queue is empty."""
    async with aiohttp.ClientSession(timeout=REQUEST_TIMEOUT) as session:
        while not queue.empty():
            index, prompt = queue.get_nowait()
            try:
                results[index] = await stream_one(session, base_url, prompt)
            except Exception as exc:  # noqa: BLE001 - recorded, asserted on below
                results[index] = {"outcome": "broken", "error": repr(exc)}


async def watch_queue(server: ServerProcess, stop: asyncio.Event) -> int:
    """The longest queue /v1/status reported while the clients ran."""
    longest = 0
    async with aiohttp.ClientSession() as session:
        while not stop.is_set():
            async with session.get(f"{server.base_url}/v1/status") as r:
                longest = max(longest, (await r.json())["queue_length"])
            await asyncio.sleep(0.2)
    return longest


async def test_concurrent_streams_match_the_sequential_answers(server: ServerProcess) -> None:
    base_url = server.base_url
    async with aiohttp.ClientSession(timeout=REQUEST_TIMEOUT) as session:
        prompts = await distinct_first_token_prompts(session, base_url, NUM_REQUESTS)
        expected = await sequential_answers(session, base_url, prompts)
    requests_before = server.status()["counters"]["requests_total"]

    order = list(enumerate(prompts))
    random.Random(0).shuffle(order)  # neighbours differ from the sequential run
    queue: asyncio.Queue = asyncio.Queue()
    for item in order:
        queue.put_nowait(item)
    results: dict[int, dict] = {}
    stop = asyncio.Event()
    watcher = asyncio.create_task(watch_queue(server, stop))
    await asyncio.gather(*(client(base_url, queue, results) for _ in range(NUM_CLIENTS)))
    stop.set()
    longest_queue = await watcher

    assert sorted(results) == list(range(NUM_REQUESTS)), "requests were lost"
    outcomes = [r["outcome"] for r in results.values()]
    assert set(outcomes) <= {"ok", "refused"}, [r for r in results.values()
                                                if r["outcome"] not in ("ok", "refused")][:3]
    for index, result in results.items():
        if result["outcome"] == "refused":
            assert result["status"] in (429, 503) and "message" in result["body"]["error"]
            continue
        text, num_tokens = expected[index]
        assert result["text"] == text, (prompts[index], result["text"], text)
        assert result["usage"]["completion_tokens"] == num_tokens
        assert result["done"] and result["finish_reason"] in ("stop", "length")
        assert len(result["ids"]) == 1  # every chunk of the stream belongs to one response
    num_ok = outcomes.count("ok")
    assert num_ok >= NUM_REQUESTS // 2, f"only {num_ok} of {NUM_REQUESTS} completed"
    assert server.status()["counters"]["requests_total"] - requests_before == num_ok
    # The clients really overlapped: most of them waited in the server's queue at once.
    assert longest_queue >= NUM_CLIENTS // 2, longest_queue
