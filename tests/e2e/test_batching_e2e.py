"""Several clients at once against the real `strata serve` (default model, engine process) with
the official openai SDK (issue 22): parallel greedy streams equal the same requests run alone,
conversations that alternate without a slot field keep their caches, and a stream cancelled
mid-batch frees its slot for the next request."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import openai
import pytest

from strata.default_model import DefaultModelError, default_model_path
from tests.e2e.server import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

NUM_CLIENTS = 8
MAX_TOKENS = 24
# Batched and single-sequence kernels may round differently: where greedy outputs part, the
# run alone must have had two candidates this close (in nats) at that token.
NEAR_TIE_NATS = 0.05
QUESTIONS = ("What is the capital of France?", "Name three primary colours.",
             "How many legs does a spider have?", "What is 12 times 12?",
             "Who wrote Hamlet?", "What gas do plants take in?",
             "Spell the word 'banana' backwards.", "What is the boiling point of water?")
# A long opening, so that re-reading it would show in cached_tokens.
HANDBOOK = " ".join(f"Rule {i}: answer briefly, politely and truthfully, in plain words."
                    for i in range(1, 31))


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[ServerProcess]:
    try:
        default_model_path(fetch=True, progress=False)
    except DefaultModelError as exc:
        pytest.skip(f"the default model is not available: {exc}")
    options = ("--slots", "4", "--parallel", "4", "--max-queue", "16")
    with ServerProcess(tmp_path_factory.mktemp("serve-batch"), options).running() as process:
        yield process


@pytest.fixture
def client(server: ServerProcess) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused",
                              max_retries=0, timeout=300)


async def greedy_stream(client: openai.AsyncOpenAI, question: str,
                        max_tokens: int = MAX_TOKENS) -> list[tuple[str, list[float]]]:
    """(token, the top-2 logprobs) per generated token of a streamed greedy chat."""
    stream = await client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": question}], temperature=0,
        max_tokens=max_tokens, logprobs=True, top_logprobs=2, stream=True)
    tokens = []
    async for chunk in stream:
        for choice in chunk.choices:
            for entry in (choice.logprobs.content or []) if choice.logprobs else []:
                tokens.append((entry.token, [alt.logprob for alt in entry.top_logprobs]))
    return tokens


def first_divergence(alone: list, batched: list) -> int | None:
    for i, (a, b) in enumerate(zip(alone, batched, strict=False)):
        if a[0] != b[0]:
            return i
    return None if len(alone) == len(batched) else min(len(alone), len(batched))


async def test_parallel_greedy_streams_equal_each_request_run_alone(client, server):
    alone = [await greedy_stream(client, q) for q in QUESTIONS]
    status_seen: list[dict] = []

    async def watch() -> None:
        while True:
            status_seen.append(await asyncio.to_thread(server.status))
            await asyncio.sleep(0.05)

    watcher = asyncio.create_task(watch())
    try:
        batched = await asyncio.gather(*(greedy_stream(client, q) for q in QUESTIONS))
    finally:
        watcher.cancel()
    for question, one, many in zip(QUESTIONS, alone, batched, strict=True):
        assert one, question
        where = first_divergence(one, many)
        if where is None:
            continue
        assert where < min(len(one), len(many)), f"{question!r}: one output stopped early"
        top = one[where][1]
        gap = top[0] - top[1] if len(top) > 1 else float("inf")
        assert gap <= NEAR_TIE_NATS, (
            f"{question!r} parts at token {where} ({one[where][0]!r} alone, "
            f"{many[where][0]!r} batched) where the top two were {gap:.3f} nats apart")
    # The host sent up to --parallel at once and queued the rest (not one at a time).
    assert max(s["batch"]["running"] for s in status_seen) == 4
    assert server.wait_idle()["batch"] == {"running": 0, "waiting": 0, "parallel": 4,
                                           "max_queue": 16, "num_slots": 4}


async def test_alternating_conversations_without_a_slot_keep_their_caches(client):
    # They differ from their first words: one slot for both would reuse almost nothing.
    conversations = {
        name: [{"role": "system", "content": f"You are assistant {name}{name * 8}. {HANDBOOK}"}]
        for name in ("A", "B")}
    turns = ("Say hello.", "Now say goodbye.", "And thank you.")
    cached: dict[str, list[tuple[int, int]]] = {"A": [], "B": []}
    for turn in turns:
        for name, messages in conversations.items():
            messages.append({"role": "user", "content": turn})
            answer = await client.chat.completions.create(
                model="default", messages=messages, temperature=0, max_tokens=12)
            messages.append({"role": "assistant", "content": answer.choices[0].message.content})
            usage = answer.usage
            cached[name].append((usage.prompt_tokens_details.cached_tokens,
                                 usage.prompt_tokens))
    for name, counts in cached.items():
        for turn, (num_cached, num_prompt) in enumerate(counts[1:], start=2):
            # Everything up to the last answer was in the slot: only the new turn is read.
            assert num_cached >= num_prompt - 40, (
                f"conversation {name}, turn {turn}: {num_cached} of {num_prompt} prompt tokens "
                f"reused; the other conversation evicted its cache ({cached})")


async def test_cancelling_a_stream_mid_batch_frees_its_slot(client, server):
    long_question = "Count from one to two hundred, one number per line."

    async def run(max_tokens: int) -> int:
        stream = await client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": long_question}],
            temperature=0, max_tokens=max_tokens, stream=True)
        num_chunks = 0
        async for _ in stream:
            num_chunks += 1
        return num_chunks

    others = [asyncio.create_task(run(400)) for _ in range(3)]
    doomed = await client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": long_question}],
        temperature=0, max_tokens=400, stream=True)
    num_read = 0
    async for _ in doomed:
        num_read += 1
        if num_read == 3:
            break
    await doomed.close()  # the client goes away mid-batch
    deadline_s = time.monotonic() + 20
    while time.monotonic() < deadline_s:
        status = await asyncio.to_thread(server.status)
        if status["batch"]["running"] <= 3:
            break
        await asyncio.sleep(0.05)
    assert status["batch"]["running"] <= 3, status["batch"]
    # Its slot is free again: a new request runs to its end while the others still decode.
    short = await client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Say yes."}],
        temperature=0, max_tokens=4)
    assert short.choices[0].finish_reason in ("stop", "length")
    still_running = not all(task.done() for task in others)
    results = await asyncio.gather(*others)
    assert all(n > 0 for n in results)
    assert still_running, "the new request waited for the whole batch, not for a free slot"
    slots = await asyncio.to_thread(server.get_json, "/slots")
    assert not any(row.get("is_running") for row in slots)
    assert server.wait_idle()["counters"]["finish_reasons"].get("cancelled", 0) >= 1
