"""Levels by action (DESIGN §4) through the real Service, Supervisor and engine process loop.

The fake engine raises when a generation touches a released arena, so an answer after coming
back that equals the answer before proves the service brought back what it needed first.
"""

from __future__ import annotations

import asyncio
import itertools
import os

import pytest
import pytest_asyncio
from fakes.fake_engine import expected_tokens
from fakes.services import EXPERT_BYTES, WEIGHTS_BYTES, answer, make_service, moe, request

from strata.engine.service.facade import ServiceError

pytestmark = [pytest.mark.timeout(120), pytest.mark.asyncio(loop_scope="module")]

DOWN = ("release_experts", "offload_session", "sleep", "unload")
PROMPT = (11, 12, 13, 14)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def service(tiny_model_dir, tmp_path_factory):
    snapshot_dir = str(tmp_path_factory.mktemp("slots"))  # survives unload, like persist
    service = make_service(tiny_model_dir, engine=moe(token_delay_s=0.002,
                                                      snapshot_dir=snapshot_dir))
    await service.start()
    yield service
    await service.stop()


def expected_levels(actions: tuple[str, ...]) -> dict[str, str]:
    if "unload" in actions:
        return {"experts": "none", "session": "none", "weights": "unloaded"}
    if "sleep" in actions:
        return {"experts": "released", "session": "offloaded", "weights": "sleeping"}
    return {"experts": "released" if "release_experts" in actions else "resident",
            "session": "offloaded" if "offload_session" in actions else "resident",
            "weights": "resident"}


def expected_state(levels: dict[str, str]) -> str:
    if levels["weights"] != "resident":
        return "unloaded" if levels["weights"] == "unloaded" else "sleeping"
    if levels["session"] == "offloaded":
        return "session_offloaded"
    return "experts_released" if levels["experts"] == "released" else "loaded"


async def test_a_fresh_load_reports_every_level_and_its_bytes(service):
    await service.control("load")
    await answer(service, PROMPT)
    status = service.status()
    assert status["state"] == "loaded"
    assert status["levels"] == {"experts": "resident", "session": "resident", "weights": "resident"}
    assert status["vram"]["weights"] == {"resident_bytes": WEIGHTS_BYTES, "released_bytes": 0}
    assert status["vram"]["experts"] == {"resident_bytes": EXPERT_BYTES, "released_bytes": 0}
    assert status["vram"]["kv"]["resident_bytes"] > 0
    assert status["engine"]["pid"] == status["engine_pid"] and status["engine"]["state"] == "loaded"
    assert status["experts"]["num_hits"] > 0 and status["slots"][0]["n_tokens"] == len(PROMPT) + 6
    assert set(status["idle"]) == {"cache_release", "session_offload", "sleep", "unload"}
    assert all(v is None for v in status["idle"].values())  # every timer is off by default


@pytest.mark.parametrize("first,second", list(itertools.product(DOWN, DOWN)))
async def test_each_level_from_each_level_and_back(service, first, second):
    await service.control("load")
    before, _ = await answer(service, PROMPT)  # a session to offload, the answer to compare
    freed = 0
    for action in (first, second):
        result = await service.control(action)
        assert result["action"] == action
        freed += result["freed_bytes"]
    status = service.status()
    levels = expected_levels((first, second))
    assert status["levels"] == levels
    assert status["state"] == expected_state(levels)
    if levels["weights"] == "unloaded":
        assert status["vram"] == {} and status["engine_pid"] is None
    else:
        vram = status["vram"]
        experts_gone = levels["experts"] == "released"
        assert vram["experts"]["resident_bytes"] == (0 if experts_gone else EXPERT_BYTES)
        assert vram["weights"]["resident_bytes"] == (0 if levels["weights"] == "sleeping"
                                                     else WEIGHTS_BYTES)
        if levels["session"] == "offloaded":
            assert vram["kv"]["resident_bytes"] == 0
    assert freed > 0

    after, usage = await answer(service, PROMPT)  # comes back by itself, before any event
    assert after == before == expected_tokens(PROMPT, 6)
    # The session survives every level but unload (snapshot in RAM, restored on generate).
    assert usage.cached_tokens == (0 if levels["weights"] == "unloaded" else len(PROMPT) - 1)
    status = service.status()
    assert status["state"] == "loaded"
    assert status["levels"] == {"experts": "resident", "session": "resident", "weights": "resident"}


async def test_going_down_twice_changes_nothing_the_second_time(service):
    await service.control("load")
    await answer(service, PROMPT)
    for action in DOWN:
        await service.control(action)
        again = await service.control(action)
        assert again["changed"] is False and again["freed_bytes"] == 0
        await service.control("load")
        await answer(service, PROMPT)


async def test_wake_and_refill_bring_the_levels_back_without_a_request(service):
    await service.control("load")
    await answer(service, PROMPT)
    await service.control("sleep")
    woken = await service.control("wake")
    assert woken["changed"] is True and woken["levels"]["weights"] == "resident"
    assert woken["levels"]["experts"] == "resident"
    # The KV comes back with the slot's next request, as the engine restores it then.
    assert woken["state"] == "session_offloaded"
    assert woken["vram"]["weights"]["resident_bytes"] == WEIGHTS_BYTES

    await service.control("release_experts")
    refilled = await service.control("refill")  # the alias
    assert refilled["action"] == "refill_experts" and refilled["changed"] is True
    assert refilled["levels"]["experts"] == "resident"
    assert (await service.control("refill_experts"))["changed"] is False

    unloaded = await service.control("unload")
    assert (await service.control("wake"))["changed"] is False  # nothing to wake: load does
    assert service.status()["state"] == "unloaded"
    assert unloaded["engine"]["standby_pid"]
    loaded = await service.control("load")
    assert loaded["state"] == "loaded" and loaded["changed"] is True


async def test_going_down_while_a_request_runs_is_409_and_changes_nothing(service):
    await service.control("load")
    stream = service.generate(request([3], max_tokens=100_000))
    await anext(stream)
    assert service.status()["state"] == "busy" and service.status()["is_busy"]
    for action in DOWN:
        with pytest.raises(ServiceError) as refused:
            await service.control(action)
        assert (refused.value.status, refused.value.code) == (409, "busy")
    await stream.aclose()
    assert service.status()["state"] == "loaded"
    assert service.status()["counters"]["level_failures"].get("sleep") is None


async def test_requests_queued_behind_a_level_change_run_after_it(service):
    await service.control("load")
    await service.control("sleep")
    wake = asyncio.create_task(service.control("wake"))
    await asyncio.sleep(0)  # the wake holds the lane first
    ids, _ = await answer(service, [21, 22], max_tokens=3)
    await wake
    assert ids == expected_tokens([21, 22], 3)
    assert service.status()["state"] == "loaded"


async def test_slot_save_erase_restore_and_list(service):
    await service.control("load")
    await answer(service, [5, 6, 7], slot=1)
    saved = await service.control("slot_save", slot=1, filename="one.json")
    assert saved["result"]["n_saved"] == 9
    await service.control("slot_erase", slot=1)
    listed = await service.control("slots")
    assert listed["slots"][1]["n_tokens"] == 0
    await service.control("unload")  # a restore brings the model back first
    restored = await service.control("slot_restore", slot=1, filename="one.json")
    assert restored["result"]["n_restored"] == 9 and restored["state"] == "loaded"
    _, usage = await answer(service, [5, 6, 7, 8], slot=1)
    assert usage.cached_tokens == 3
    for bad in ({"slot": 9, "filename": "x"}, {"slot": 1, "filename": "../x"}, {"slot": 1}):
        with pytest.raises(ServiceError) as refused:
            await service.control("slot_save", **bad)
        assert refused.value.status == 400
    with pytest.raises(ServiceError) as missing:
        await service.control("slot_restore", slot=2, filename="never-saved.json")
    assert missing.value.status == 400 and "slot restore failed" in missing.value.message


async def test_dense_model_levels_that_do_not_apply_say_why(tiny_model_dir):
    dense = make_service(tiny_model_dir)
    await dense.start()
    try:
        await answer(dense, PROMPT)
        assert dense.status()["levels"]["experts"] == "none"
        for action in ("release_experts", "refill_experts"):
            with pytest.raises(ServiceError) as refused:
                await dense.control(action)
            assert (refused.value.status, refused.value.code) == (400, "not_applicable")
            assert "dense model has no expert cache" in refused.value.message
        assert dense.status()["state"] == "loaded"
        assert "experts" not in dense.status()["vram"]
        await dense.control("sleep")  # the other levels apply to a dense model too
        ids, _ = await answer(dense, PROMPT)
        assert ids == expected_tokens(PROMPT, 6)
    finally:
        await dense.stop()


async def test_a_wake_without_vram_answers_503_and_stays_asleep(tiny_model_dir, tmp_path):
    oom_file = tmp_path / "no-vram"
    oom = make_service(tiny_model_dir, engine=moe(oom_file=str(oom_file)))
    await oom.start()
    try:
        await answer(oom, PROMPT)
        await oom.control("sleep")
        oom_file.touch()
        with pytest.raises(ServiceError) as refused:
            await oom.control("wake")
        assert (refused.value.status, refused.value.code) == (503, "insufficient_vram")
        assert "64 MiB missing" in refused.value.message and refused.value.retry_after_s
        with pytest.raises(ServiceError) as at_request:
            await anext(oom.generate(request(PROMPT)))  # a clean error before any event
        assert at_request.value.code == "insufficient_vram"
        status = oom.status()
        # Waiting for VRAM is a state, not an error: the level stays, the reason is shown.
        assert status["state"] == "sleeping" and status["last_error"] is None
        assert "64 MiB missing" in status["waiting_for_vram"]["reason"]
        assert status["vram"]["weights"]["released_bytes"] == WEIGHTS_BYTES
        os.unlink(oom_file)
        ids, usage = await answer(oom, PROMPT)  # the next try succeeds, nothing lost
        assert ids == expected_tokens(PROMPT, 6) and usage.cached_tokens == len(PROMPT) - 1
        assert oom.status()["last_error"] is None and oom.status()["waiting_for_vram"] is None
    finally:
        await oom.stop()
