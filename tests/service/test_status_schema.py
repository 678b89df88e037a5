"""Service.status() has one shape (status_schema.ServiceStatus): the real service, run with a
real engine process, and every fake the tray and API tests use produce exactly it, side by side
(issue #17 item 19: the tray read keys only a fake produced and showed 0 for real)."""

from __future__ import annotations

import asyncio

import pytest
from fakes.services import answer, make_service

from strata.engine.service.service import Service
from strata.engine.service.settings import ServeSettings
from strata.engine.service.status_schema import ServiceStatus
from tests.api.fake_service import FakeService as ApiFakeService
from tests.app.fakes import FakeService as TrayFakeService
from tests.helpers.status_shape import shape_problems

pytestmark = pytest.mark.timeout(180)


def key_paths(value: dict, prefix: str = "") -> set[str]:
    """Keys of a status, nested TypedDict parts (engine, counters) spelled a.b."""
    paths = set()
    for key, item in value.items():
        paths.add(prefix + key)
        if key in ("engine", "counters") and isinstance(item, dict):
            paths |= key_paths(item, f"{prefix}{key}.")
    return paths


def fake_statuses() -> dict[str, dict]:
    tray_busy = TrayFakeService()
    tray_busy.is_busy = True
    return {
        "tray fake, loaded": TrayFakeService().status(),
        "tray fake, busy": tray_busy.status(),
        "tray fake, unloaded": TrayFakeService(state="unloaded").status(),
        "api fake": ApiFakeService(text=None).status(),
    }


@pytest.fixture(scope="module")
def real_statuses(smollm2_gguf) -> dict[str, dict]:
    """The real Service over the real engine (default model, CPU): loaded after a request,
    then unloaded. Stopping right after the unload, with an idle timer set, also checks that
    stop() ends the timers (it hung: Python 3.11's wait_for dropped the cancel)."""
    return asyncio.run(_real_statuses(smollm2_gguf))


async def _real_statuses(smollm2_gguf) -> dict[str, dict]:
    service = Service(ServeSettings(model=str(smollm2_gguf), device="cpu", context_tokens=512,
                                    sleep_idle_s=300.0), keep_standby=False)
    await service.start()
    try:
        prompt = service.text.encode("The capital of France is")
        await answer(service, prompt, max_tokens=4)
        loaded = service.status()
        await service.control("unload")
        unloaded = service.status()
    finally:
        await service.stop()
    assert loaded["counters"]["tokens_per_second"] > 0
    return {"real, loaded": loaded, "real, unloaded": unloaded}


@pytest.mark.slow
async def test_the_real_service_status_has_the_schema(real_statuses):
    for name, status in real_statuses.items():
        assert shape_problems(status, ServiceStatus) == [], name


@pytest.mark.slow
async def test_every_fake_has_the_real_keys_and_types(real_statuses):
    real_keys = key_paths(real_statuses["real, loaded"])
    for name, status in fake_statuses().items():
        assert key_paths(status) == real_keys, name
        assert shape_problems(status, ServiceStatus) == [], name


async def test_the_service_over_the_fake_engine_has_the_schema(tiny_model_dir):
    # The fake engine runs in a real engine process, under the real Service: the cheap check.
    service = make_service(tiny_model_dir, sleep_idle_s=60.0)
    await service.start()
    try:
        await answer(service, [5, 6, 7], max_tokens=3)
        assert shape_problems(service.status(), ServiceStatus) == []
    finally:
        await service.stop()
    assert shape_problems(service.status(), ServiceStatus) == []
    for name, status in fake_statuses().items():
        assert shape_problems(status, ServiceStatus) == [], name
