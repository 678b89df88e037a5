"""shrink_experts through the Service, the HTTP route and a rule (fake engine, injected free
VRAM): slots go until N MiB are free, requests keep being answered, and the cache grows back
as VRAM frees."""

from __future__ import annotations

import asyncio

import pytest
from fakes.fake_engine import NUM_EXPERT_SLOTS, NUM_EXPERTS
from fakes.services import EXPERT_BYTES, answer, make_service, moe

from strata.engine.api import create_app
from strata.engine.service import expert_shrink
from strata.engine.service.facade import ServiceError
from strata.engine.service.rules import Rule
from strata.engine.service.rules_engine import RulesEngine
from strata.units import MIB

pytestmark = pytest.mark.timeout(120)
BYTES_PER_EXPERT = EXPERT_BYTES // NUM_EXPERT_SLOTS  # 0.5 MiB


class Gpu:
    """Free VRAM that follows what the fake engine holds and what "another program" holds."""

    def __init__(self, service, total_mib: int = 1000):
        self.service = service
        self.total_bytes = total_mib * MIB
        self.other_bytes = 0

    def __call__(self) -> int:
        status = self.service.status()
        held = sum(a["resident_bytes"] for a in status["vram"].values())
        return self.total_bytes - held - self.other_bytes


def slots(service) -> int:
    return service.status()["experts"]["num_slots"]


async def test_shrink_keeps_serving_and_grows_back_as_vram_frees(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(expert_shrink, "GROW_INTERVAL_S", 0.05)
    gpu_box = {}
    service = make_service(tiny_model_dir, engine=moe(), vram_reader=lambda: gpu_box["gpu"]())
    gpu = gpu_box["gpu"] = Gpu(service)
    await service.start()
    try:
        await answer(service, (5, 6, 7))
        gpu.other_bytes = gpu() - 4 * MIB  # another program leaves 4 MiB free; it wants 10
        result = await service.control("shrink_experts", keep_free_mib=10)
        assert result["changed"] and result["is_target_met"] and gpu() >= 10 * MIB
        assert slots(service) == NUM_EXPERT_SLOTS - 12  # 6 MiB missing: 12 slots of 0.5 MiB
        assert result["freed_bytes"] == 12 * BYTES_PER_EXPERT
        ids, _ = await answer(service, (5, 6, 7, 8))  # still serving from the partial cache
        assert ids and service.status()["state"] == "loaded"
        gpu.other_bytes = 0  # the other program exits: the grower maps the slots back
        for _ in range(100):
            if slots(service) == NUM_EXPERT_SLOTS:
                break
            await asyncio.sleep(0.02)
        assert slots(service) == NUM_EXPERT_SLOTS
        assert service.status()["vram"]["experts"]["resident_bytes"] == EXPERT_BYTES
    finally:
        await service.stop()


async def test_shrink_stops_at_one_layers_experts_and_refill_grows_back(tiny_model_dir):
    gpu_box = {}
    service = make_service(tiny_model_dir, engine=moe(), vram_reader=lambda: gpu_box["gpu"]())
    gpu = gpu_box["gpu"] = Gpu(service)
    await service.start()
    try:
        gpu.other_bytes = gpu()  # nothing free; ask for far more than the cache holds
        result = await service.control("shrink_experts", keep_free_mib=500)
        assert slots(service) == NUM_EXPERTS and not result["is_target_met"]
        gpu.other_bytes = 0
        assert (await service.control("refill_experts"))["changed"]
        assert slots(service) == NUM_EXPERT_SLOTS
        with pytest.raises(ServiceError) as bad:
            await service.control("shrink_experts")
        assert bad.value.status == 400 and "keep_free_mib" in bad.value.message
    finally:
        await service.stop()


async def test_a_dense_model_cannot_shrink(tiny_model_dir):
    service = make_service(tiny_model_dir, vram_reader=lambda: 100 * MIB)
    await service.start()
    try:
        with pytest.raises(ServiceError) as refused:
            await service.control("shrink_experts", keep_free_mib=500)
        assert refused.value.status == 400 and "no expert cache" in refused.value.message
    finally:
        await service.stop()


async def test_the_route_takes_keep_free_mib_and_refuses_anything_else(tiny_model_dir,
                                                                       aiohttp_client):
    gpu_box = {}
    service = make_service(tiny_model_dir, engine=moe(), vram_reader=lambda: gpu_box["gpu"]())
    gpu = gpu_box["gpu"] = Gpu(service)
    await service.start()
    try:
        client = await aiohttp_client(create_app(service))
        gpu.other_bytes = gpu() - 2 * MIB
        response = await client.post("/cache/shrink", json={"keep_free_mib": 3})
        assert response.status == 200 and (await response.json())["num_slots"] == 62
        for body in ({"keep_free_mib": -1}, {"keep_free_mib": "3"}, {"keep_free": 3}, {}):
            response = await client.post("/cache/shrink", json=body)
            assert response.status == 400, body
    finally:
        await service.stop()


async def test_a_shrink_rule_shrinks_then_refills_when_the_program_exits(tiny_model_dir):
    from tests.service.test_rules import World  # the fake process list of the rules tests

    gpu_box = {}
    service = make_service(tiny_model_dir, engine=moe(), vram_reader=lambda: gpu_box["gpu"]())
    gpu = gpu_box["gpu"] = Gpu(service)
    await service.start()
    world = World()
    rule = Rule("Game", "process", "shrink_experts", "restore", ("game",), keep_free_mib=5)
    engine = RulesEngine(service, [rule], process_lister=world.lister)
    try:
        gpu.other_bytes = gpu() - 2 * MIB
        world.procs.append(world.procs[0].__class__(77, "game", "/opt/game/game", "game"))
        await engine.poll_once()
        assert slots(service) == NUM_EXPERT_SLOTS - 6
        world.procs.pop()
        gpu.other_bytes = 0
        await engine.poll_once()
        assert slots(service) == NUM_EXPERT_SLOTS
        counters = service.status()["counters"]["level_changes"]
        assert counters["shrink_experts"] == 1 and counters["refill_experts"] == 1
    finally:
        await service.stop()


async def test_a_shrink_while_a_stream_decodes_lands_between_its_tokens(tiny_model_dir,
                                                                       monkeypatch):
    """Issue 54: a rule or the route shrinks while a chat streams: no 409, the cache is
    smaller at the next tokens, the stream loses none, and the grower maps the slots back
    while it still streams (the engine answers ResizeExperts between steps)."""
    from fakes.fake_engine import expected_tokens

    monkeypatch.setattr(expert_shrink, "GROW_INTERVAL_S", 0.05)
    gpu_box = {}
    service = make_service(tiny_model_dir, engine=moe(token_delay_s=0.02),
                           vram_reader=lambda: gpu_box["gpu"]())
    gpu = gpu_box["gpu"] = Gpu(service)
    await service.start()
    try:
        await answer(service, (5, 6, 7))  # loaded
        stream = asyncio.create_task(answer(service, (1, 2, 3), max_tokens=150))
        for _ in range(500):
            if service.lifecycle.gate.num_running:
                break
            await asyncio.sleep(0.01)
        gpu.other_bytes = gpu() - 4 * MIB
        result = await service.control("shrink_experts", keep_free_mib=10)
        assert not stream.done(), "the shrink waited for the stream to end"
        assert result["changed"] and slots(service) == NUM_EXPERT_SLOTS - 12
        gpu.other_bytes = 0  # the game leaves: the slots come back mid-stream
        for _ in range(100):
            if slots(service) == NUM_EXPERT_SLOTS or stream.done():
                break
            await asyncio.sleep(0.02)
        assert not stream.done() and slots(service) == NUM_EXPERT_SLOTS
        ids, usage = await stream
        assert ids == expected_tokens((1, 2, 3), 150) and usage.completion_tokens == 150
    finally:
        await service.stop()
