"""Several clients at once through the real HTTP server (start_listening, as `strata serve`
binds it), the real Service and engine process loop over the fake engine (issue 22): streams
that overlap all finish, a full queue answers 503 with Retry-After in each API's shape, a
client that disconnects leaves the queue, levels refuse while work runs, idle timers wait for
the last sequence, and slots are the engine's to pick and the configuration's to bound."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any

import aiohttp
import pytest
from fakes.fake_engine import expected_tokens
from fakes.services import make_service

from strata.engine.api.listen import start_listening
from strata.engine.service.settings import ServeSettings

pytestmark = pytest.mark.timeout(120)


@contextlib.asynccontextmanager
async def serving(tiny_model_dir, *, engine: dict[str, Any] | None = None, **settings: Any):
    """(service, base URL) of a started service behind a bound API on a free port."""
    service = make_service(tiny_model_dir, engine=engine, **settings)
    await service.start()
    listening = await start_listening(service, ServeSettings(model=str(tiny_model_dir), port=0))
    try:
        yield service, listening.endpoint_url.removesuffix("/v1")
    finally:
        await listening.runner.cleanup()
        await service.stop()


async def wait_until(condition, timeout_s: float = 10.0) -> None:
    deadline_s = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline_s, "the condition never held"
        await asyncio.sleep(0.01)


async def stream_tokens(session: aiohttp.ClientSession, base: str, prompt: list[int],
                        max_tokens: int, **extra: Any) -> list[str]:
    """The text pieces of a streamed /v1/completions, until [DONE]."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, **extra}
    pieces = []
    async with session.post(f"{base}/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            text = line.decode().strip()
            if text.startswith("data: ") and text != "data: [DONE]":
                pieces.append(json.loads(text[6:])["choices"][0]["text"])
    return pieces


def words(prompt: list[int], max_tokens: int) -> str:
    """The fake engine's answer to a prompt as the tiny tokenizer spells it (w<id>)."""
    return " ".join(f"w{t}" for t in expected_tokens(prompt, max_tokens))


async def test_eight_overlapping_streams_all_finish_with_their_own_tokens(tiny_model_dir):
    async with serving(tiny_model_dir, engine={"token_delay_s": 0.01}) as (service, base):
        async with aiohttp.ClientSession() as session:
            seen: list[dict] = []

            async def watch() -> None:
                while True:
                    async with session.get(f"{base}/v1/status") as resp:
                        seen.append((await resp.json())["batch"])
                    await asyncio.sleep(0.01)

            watcher = asyncio.create_task(watch())
            prompts = [[20 + i, 30 + i] for i in range(8)]
            results = await asyncio.gather(*(stream_tokens(session, base, p, 12)
                                             for p in prompts))
            watcher.cancel()
            for prompt, pieces in zip(prompts, results, strict=True):
                assert "".join(pieces).split() == words(prompt, 12).split()
            # Four (one per slot) ran at once while the other four waited on the host.
            assert max(b["running"] for b in seen) == 4
            assert max(b["waiting"] for b in seen) >= 1
            assert all(b["running"] <= 4 and b["parallel"] == 4 for b in seen)
            metrics = await (await session.get(f"{base}/metrics")).text()
        assert "strata_request_duration_seconds_count 8" in metrics
        assert "strata_time_to_first_token_seconds_count 8" in metrics
        assert "strata_inter_token_latency_seconds_count " in metrics
        assert "strata_requests_running 0" in metrics and "strata_requests_waiting 0" in metrics
        assert service.status()["batch"] == {"running": 0, "waiting": 0, "parallel": 4,
                                             "max_queue": 64, "num_slots": 4}


async def _fill(session: aiohttp.ClientSession, base: str, service) -> list[asyncio.Task]:
    """One endless stream running and one waiting: a queue of one is then full."""
    running = asyncio.create_task(stream_tokens(session, base, [5], 4000))
    await wait_until(lambda: service.status()["batch"]["running"] == 1)
    waiting = asyncio.create_task(stream_tokens(session, base, [6], 3))
    await wait_until(lambda: service.status()["batch"]["waiting"] == 1)
    return [running, waiting]


QUEUE_FULL_SHAPES = [
    ("/v1/completions", {"prompt": [7], "max_tokens": 3},
     lambda body: body["error"]["code"] == "queue_full"
     and body["error"]["type"] == "unavailable_error"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w9"}], "stream": True},
     lambda body: body["error"]["code"] == "queue_full"),
    ("/v1/messages", {"messages": [{"role": "user", "content": "w9"}], "max_tokens": 3,
                      "stream": True},
     lambda body: body["type"] == "error" and body["error"]["type"] == "overloaded_error"),
    ("/api/generate", {"model": "m", "prompt": "w9", "stream": True},
     lambda body: set(body) == {"error"} and "busy" in body["error"]),
    ("/completion", {"prompt": "w9", "n_predict": 3},
     lambda body: body["error"]["code"] == "queue_full"),
]


async def test_past_the_queue_bound_each_api_answers_503_with_retry_after(tiny_model_dir):
    engine = {"token_delay_s": 0.02, "num_slots": 1}
    async with serving(tiny_model_dir, engine=engine, max_queue=1) as (service, base):
        async with aiohttp.ClientSession() as session:
            tasks = await _fill(session, base, service)
            for path, body, is_its_shape in QUEUE_FULL_SHAPES:
                if path == "/api/generate":
                    body = {**body, "model": service.model_id}
                async with session.post(f"{base}{path}", json=body) as resp:
                    answer = await resp.json()
                    assert resp.status == 503, (path, answer)
                    assert resp.content_type == "application/json"  # before any SSE header
                    assert int(resp.headers["Retry-After"]) >= 1, path
                    assert is_its_shape(answer), (path, answer)
                    assert "max_queue 1" in json.dumps(answer)
            assert service.status()["counters"]["rejected_total"] >= len(QUEUE_FULL_SHAPES)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        await wait_until(lambda: not service.status()["is_busy"])


async def test_a_client_that_disconnects_while_queued_leaves_the_queue(tiny_model_dir):
    engine = {"token_delay_s": 0.02, "num_slots": 1}
    async with serving(tiny_model_dir, engine=engine, max_queue=1) as (service, base):
        async with aiohttp.ClientSession() as session:
            running = asyncio.create_task(stream_tokens(session, base, [5], 4000))
            await wait_until(lambda: service.status()["batch"]["running"] == 1)
            # A real client with its own connection, closed while its request waits.
            quitter = aiohttp.ClientSession()
            queued = asyncio.create_task(quitter.post(f"{base}/v1/completions",
                                                      json={"prompt": [6], "max_tokens": 3}))
            await wait_until(lambda: service.status()["batch"]["waiting"] == 1)
            queued.cancel()
            await quitter.close()
            await wait_until(lambda: service.status()["batch"]["waiting"] == 0, timeout_s=2.0)
            # Its place is free at once: another request queues instead of a 503.
            after = asyncio.create_task(stream_tokens(session, base, [8], 2))
            await wait_until(lambda: service.status()["batch"]["waiting"] == 1)
            assert service.status()["batch"]["running"] == 1  # the first still runs
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
            assert "".join(await asyncio.wait_for(after, 20)).split() == words([8], 2).split()
        assert service.status()["counters"]["requests_total"] >= 2


async def test_a_level_change_during_generations_is_409_and_unload_waits_its_turn(
        tiny_model_dir):
    async with serving(tiny_model_dir, engine={"token_delay_s": 0.02}) as (service, base):
        wakes: list[object] = []
        command = service.supervisor.command

        async def counting(cmd, *args, **kwargs):
            if type(cmd).__name__ == "Wake":
                wakes.append(cmd)
            return await command(cmd, *args, **kwargs)

        service.supervisor.command = counting
        async with aiohttp.ClientSession() as session:
            streams = [asyncio.create_task(stream_tokens(session, base, [40 + i], 30))
                       for i in range(3)]
            await wait_until(lambda: service.status()["batch"]["running"] == 3)
            for route in ("/sleep", "/unload", "/session/offload"):
                async with session.post(f"{base}{route}") as resp:
                    assert resp.status == 409, route
                    assert "3 requests run" in (await resp.json())["error"]["message"]
            await asyncio.gather(*streams)
            async with session.post(f"{base}/sleep") as resp:
                assert resp.status == 200, await resp.text()
            # Several requests at once at a lower level: the model wakes once, all answer.
            results = await asyncio.gather(*(stream_tokens(session, base, [50 + i], 4)
                                             for i in range(4)))
            assert all(len("".join(r).split()) == 4 for r in results)
        assert len(wakes) == 1
        assert service.status()["state"] == "loaded"


async def test_idle_timers_start_after_the_last_sequence_ends(tiny_model_dir):
    async with (serving(tiny_model_dir, engine={"token_delay_s": 0.02},
                        sleep_idle_s=0.3) as (service, base),
                aiohttp.ClientSession() as session):
        short = asyncio.create_task(stream_tokens(session, base, [60], 2))
        long = asyncio.create_task(stream_tokens(session, base, [61], 40))  # ~0.8 s
        await short
        await asyncio.sleep(0.4)  # past the timeout after the short one ended
        assert not long.done()
        status = service.status()
        assert status["state"] == "busy" and status["idle"]["sleep"] == 0.3  # not counting
        await long
        ended_s = time.monotonic()
        await wait_until(lambda: service.status()["state"] == "sleeping", timeout_s=5.0)
        assert time.monotonic() - ended_s >= 0.25  # a full timeout after the last one


async def test_requests_without_a_slot_let_the_engine_pick_a_free_one(tiny_model_dir):
    async with serving(tiny_model_dir, engine={"num_slots": 6}) as (_, base):
        async with aiohttp.ClientSession() as session:
            conversations = [list(range(start, start + 20)) for start in (100, 200, 300)]
            for prompt in conversations:
                await stream_tokens(session, base, prompt, 3)
            # llama.cpp's "any slot": the first conversation's prefix brings it back to its own.
            await stream_tokens(session, base, conversations[0] + [7], 3, id_slot=-1)
            slots = await (await session.get(f"{base}/slots")).json()
        # slot None each time: the engine spread the conversations over empty slots (the
        # host's old default, slot 0 for all, would have left one slot holding tokens).
        holding = {row["id"]: row["n_tokens"] for row in slots if row["n_tokens"] > 0}
        assert len(slots) == 6 and len(holding) == 3
        assert sorted(holding.values()) == [23, 23, 24]


async def test_slot_ids_are_checked_against_the_configured_count(tiny_model_dir):
    async with serving(tiny_model_dir, engine={"num_slots": 6}) as (service, base):
        async with aiohttp.ClientSession() as session:
            body = {"prompt": [3, 4], "max_tokens": 2}
            ok = await session.post(f"{base}/v1/completions",
                                    json={**body, "strata_cache_slot": 5})
            assert ok.status == 200, await ok.text()
            refused = await session.post(f"{base}/v1/completions",
                                         json={**body, "strata_cache_slot": 6})
            assert refused.status == 400
            assert "slots are 0..5" in (await refused.json())["error"]["message"]
            props = await (await session.get(f"{base}/props")).json()
            assert props["total_slots"] == 6
            assert (await session.post(f"{base}/slots/5?action=erase")).status == 200
            assert (await session.post(f"{base}/slots/6?action=erase")).status == 400
        assert service.num_slots == 6
        slots = service.status()["slots"]
        assert [row["id"] for row in slots] == list(range(6)) and slots[5]["n_tokens"] == 0
