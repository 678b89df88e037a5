"""`strata serve` end to end: settings -> Service over the fake engine -> HTTP, then a clean stop."""

from __future__ import annotations

import argparse
import asyncio
import os

import aiohttp
import pytest
from fakes.fake_engine import FAKE_ENGINE_FACTORY, FakeEngineConfig

from strata.engine.service.service import Service
from strata.engine.service.settings import (
    ServeSettings,
    add_serve_arguments,
    load_settings,
    overrides_from_args,
)
from strata.host.serve import serve
from tests.helpers.serving import serving

pytestmark = pytest.mark.timeout(60)


async def test_serve_answers_http_and_stops_the_engine(tiny_model_dir):
    settings = ServeSettings(model=str(tiny_model_dir), port=0)
    service = Service(settings, engine_factory=FAKE_ENGINE_FACTORY,
                      engine_config=FakeEngineConfig(model_path=str(tiny_model_dir)))
    stop = asyncio.Event()
    urls: list[str] = []
    server = asyncio.create_task(serve(settings, service=service, stop_event=stop,
                                       on_listening=urls.append))
    for _ in range(200):
        if urls or server.done():
            break
        await asyncio.sleep(0.05)
    assert urls, "the server did not start"
    base = urls[0].removesuffix("/v1")
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{base}/health") as response:
            assert response.status == 200
        body = {"prompt": "w5 w6", "max_tokens": 3}
        async with session.post(f"{urls[0]}/completions", json=body) as response:
            assert response.status == 200, await response.text()
            answer = await response.json()
    assert answer["usage"]["completion_tokens"] == 3
    pid = service.status()["engine_pid"]
    assert pid
    stop.set()
    assert await asyncio.wait_for(server, 20) == 0
    assert service.status()["state"] == "unloaded" and service.status()["engine_pid"] is None


async def test_metrics_and_slots_endpoints_can_be_turned_off(tiny_model_dir):
    """llama-server without --metrics (or with --no-slots) answers these 501; so does
    `strata serve --no-metrics-endpoint --no-slots-endpoint`, and only these."""
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args(["--model", str(tiny_model_dir), "--port", "0",
                              "--no-metrics-endpoint", "--no-slots-endpoint"])
    settings = load_settings(os.devnull, overrides_from_args(args), environ={})
    service = Service(settings, engine_factory=FAKE_ENGINE_FACTORY,
                      engine_config=FakeEngineConfig(model_path=str(tiny_model_dir)))
    async with serving(settings, service) as base, aiohttp.ClientSession() as session:
        for path in ("/metrics", "/slots"):
            async with session.get(f"{base}{path}") as response:
                assert response.status == 501
                error = (await response.json())["error"]
                assert error["type"] == "not_supported_error" and path[1:] in error["message"]
        async with session.get(f"{base}/props") as response:
            assert response.status == 200
