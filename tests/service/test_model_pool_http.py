"""Two real models behind `serve` (the real engine process each, CPU): requests pick them by
`model`, the second loads on its first request, and under a budget that holds one of them the
other goes down the levels and comes back on its next request (issue 24 items 3 and 4).

One server for the module: each engine start costs seconds of CI.
"""

from __future__ import annotations

import dataclasses
import shutil
import sys
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio

from strata.engine.core.model_config import ModelConfig
from strata.engine.service.model_pool import ModelPool
from strata.engine.service.model_pool_size import estimate_size
from strata.engine.service.settings import ServeSettings
from strata.units import MIB
from tests.helpers.serving import serving

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from random_gguf import write_random_gguf

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300), pytest.mark.asyncio(loop_scope="module")]

TINY = "tiny-random"
# About 28M parameters: 111 MB in float32 on the CPU, more than the budget's slack below.
TINY_CONFIG = ModelConfig(model_type="llama", vocab_size=4096, hidden_size=512,
                          intermediate_size=2048, num_hidden_layers=6, num_attention_heads=8,
                          num_key_value_heads=4, head_dim=64, max_position_embeddings=512,
                          rope_theta=10000.0)
SLACK_BYTES = 32 * MIB  # the prompts of this test stay within the first KV pages
NUM_TOKENS = 4


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def pool_server(tmp_path_factory, smollm2_gguf):
    """serve() over a ModelPool: SmolLM2 as the default, a random tiny llama in the models
    directory, a budget that holds either one but not both. Yields (base url, pool, dirs)."""
    models_dir = tmp_path_factory.mktemp("models")
    tiny_path = models_dir / f"{TINY}.gguf"
    write_random_gguf(TINY_CONFIG, tiny_path)
    sizes = [estimate_size(str(path), is_gpu=False).full_bytes
             for path in (smollm2_gguf, tiny_path)]
    assert min(sizes) > SLACK_BYTES
    settings = ServeSettings(
        model=str(smollm2_gguf), port=0, device="cpu", context_tokens=256, slots=1,
        models_dir=str(models_dir), vram_budget_bytes=max(sizes) + SLACK_BYTES,
        snapshot_dir=str(tmp_path_factory.mktemp("snapshots")))
    pool = ModelPool(settings, {TINY: {"aliases": ["gpt-4o-mini"]}})
    events = []
    pool.level_listeners.append(events.append)
    async with serving(settings, pool) as base_url:
        yield base_url, pool, models_dir, events


async def post(base: str, path: str, body: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as session, \
            session.post(f"{base}{path}", json=body) as response:
        return response.status, await response.json()


async def get(base: str, path: str) -> dict:
    async with aiohttp.ClientSession() as session, session.get(f"{base}{path}") as response:
        assert response.status == 200, await response.text()
        return await response.json()


async def states(base: str) -> dict[str, str]:
    listing = await get(base, "/v1/models")
    return {model["id"]: model["status"] for model in listing["data"]}


async def complete(base: str, model: str | None, **extra) -> dict:
    body = {"prompt": "Hello", "max_tokens": NUM_TOKENS, "temperature": 0,
            **({"model": model} if model else {}), **extra}
    status, answer = await post(base, "/v1/completions", body)
    assert status == 200, answer
    return answer


async def test_alternating_requests_load_on_demand_and_evict_under_the_budget(pool_server):
    base, pool, _, events = pool_server
    default = pool.default_name
    assert await states(base) == {default: "loaded", TINY: "available"}

    answer = await complete(base, TINY)  # JIT: its engine starts now; SmolLM2 makes room
    assert answer["model"] == TINY and answer["usage"]["completion_tokens"] == NUM_TOKENS
    assert await states(base) == {default: "sleeping", TINY: "loaded"}
    evicted = [e for e in events if e.model == default and e.action == "sleep"]
    assert evicted and evicted[-1].is_ok and evicted[-1].cause == f"to make room for {TINY}"

    answer = await complete(base, None)  # no model: the default, woken; the tiny one sleeps
    assert answer["model"] == default
    assert await states(base) == {default: "loaded", TINY: "sleeping"}

    answer = await complete(base, "gpt-4o-mini", ttl=600)  # the configured alias, a keep-alive
    assert answer["model"] == TINY
    assert await states(base) == {default: "sleeping", TINY: "loaded"}
    rows = {row["name"]: row for row in pool.status()["models"]}
    assert rows[TINY]["vram_bytes"] > 0 and rows[default]["vram_bytes"] == 0
    assert sum(row["vram_bytes"] for row in rows.values()) <= pool.budget_bytes

    # Ollama's names: ':latest', and /api/ps lists the models that hold memory.
    status, answer = await post(base, "/api/generate", {
        "model": f"{default}:latest", "prompt": "Hi", "raw": True, "stream": False,
        "keep_alive": "7m", "options": {"num_predict": NUM_TOKENS, "temperature": 0}})
    assert status == 200 and answer["done"], answer
    # Each model keeps its own keep-alive: Ollama's keep_alive here, LM Studio's ttl above.
    timeouts = {name: pool.member(name).status()["idle_timeouts"]["unload"]
                for name in (default, TINY)}
    assert timeouts == {default: 420, TINY: 600}
    running = {m["name"]: m for m in (await get(base, "/api/ps"))["models"]}
    assert running[f"{default}:latest"]["size_vram"] > 0
    assert running[f"{TINY}:latest"]["size_vram"] == 0  # asleep: holds no memory


async def test_control_routes_take_a_model(pool_server):
    base, pool, _, _ = pool_server
    status, answer = await post(base, "/load", {"model": TINY})
    assert status == 200 and answer["model"] == TINY, answer
    assert (await states(base))[TINY] == "loaded"
    status, answer = await post(base, "/unload", {"model": TINY})
    assert status == 200 and answer["state"] == "unloaded", answer
    assert (await states(base))[TINY] == "unloaded"
    status, answer = await post(base, "/sleep", {"model": "nope"})
    assert status == 404 and answer["error"]["code"] == "model_not_found", answer
    status, answer = await post(base, "/sleep", {"modell": TINY})
    assert status == 400 and "modell" in answer["error"]["message"], answer
    status_doc = await get(base, "/v1/status")
    assert status_doc["default_model"] == pool.default_name
    assert {row["name"] for row in status_doc["models"]} == {pool.default_name, TINY}
    assert all("/" not in row["path"] for row in status_doc["models"])  # file names only


async def test_unknown_models_get_a_404_in_each_apis_shape(pool_server):
    base, _, _, _ = pool_server
    messages = [{"role": "user", "content": "hi"}]
    status, answer = await post(base, "/v1/chat/completions",
                                {"model": "nope", "messages": messages})
    assert status == 404, answer
    assert answer["error"]["code"] == "model_not_found"
    assert answer["error"]["type"] == "not_found_error" and answer["error"]["param"] == "model"
    assert "/v1/models" in answer["error"]["message"]
    status, answer = await post(base, "/v1/messages",
                                {"model": "nope", "max_tokens": 4, "messages": messages})
    assert status == 404 and answer["type"] == "error", answer
    assert answer["error"]["type"] == "not_found_error"
    for path in ("/api/chat", "/api/embed", "/api/show"):
        status, answer = await post(base, path, {"model": "nope", "messages": messages,
                                                 "input": "x"})
        assert status == 404 and set(answer) == {"error"} and "nope" in answer["error"], answer
    async with aiohttp.ClientSession() as session, \
            session.get(f"{base}/v1/models/nope") as response:
        assert response.status == 404
    assert (await get(base, f"/v1/models/{TINY}:latest"))["id"] == TINY


async def test_a_model_added_after_the_start_is_found_and_the_fallback_maps_names(pool_server):
    base, pool, models_dir, _ = pool_server
    shutil.copy(models_dir / f"{TINY}.gguf", models_dir / "pulled-later.gguf")
    status, answer = await post(base, "/api/show", {"model": "pulled-later"})
    assert status == 200 and answer["details"]["family"] == "llama", answer  # no engine start
    assert (await states(base))["pulled-later"] == "available"
    pool.settings = dataclasses.replace(pool.settings, model_fallback="default")
    try:
        answer = await complete(base, "some-fixed-app-name")
        assert answer["model"] == pool.default_name
    finally:
        pool.settings = dataclasses.replace(pool.settings, model_fallback="off")
