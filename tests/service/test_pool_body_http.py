"""A ModelPool behind the real aiohttp app, over fake engines: the model-routing middleware
reads every body through the one body parser (issue 51 item 2), and a server with one model
answers any model name while one with several keeps the 404 (item 14)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from fakes.fake_engine import FAKE_ENGINE_FACTORY, FakeEngineConfig
from fakes.tiny_model import write_tiny_model_dir

from strata.engine.api import create_app
from strata.engine.api.validation import MAX_JSON_DEPTH
from strata.engine.service.model_pool import ModelPool
from strata.engine.service.model_pool_size import MemberSize
from strata.engine.service.service import Service
from strata.engine.service.settings import ServeSettings
from strata.units import MIB

MESSAGES = [{"role": "user", "content": "w5 w6"}]


def fake_service(settings: ServeSettings, *, keep_standby: bool = True,
                 vram_reader=lambda: None) -> Service:
    config = FakeEngineConfig(model_path=settings.model, weights_bytes=16 * MIB)
    return Service(settings, engine_factory=FAKE_ENGINE_FACTORY, engine_config=config,
                   vram_reader=vram_reader, keep_standby=False)


async def start_pool(tmp_path: Path, names: tuple[str, ...]) -> ModelPool:
    models_dir = tmp_path / "models"
    for name in names:
        write_tiny_model_dir(models_dir / name)
        (models_dir / name / "config.json").write_text('{"model_type": "llama"}')
        (models_dir / name / "model.safetensors").write_bytes(
            b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    settings = ServeSettings(model=str(models_dir / names[0]), device="cpu",
                             models_dir=str(models_dir),
                             snapshot_dir=str(tmp_path / "snapshots"))
    pool = ModelPool(settings, service_factory=fake_service,
                     estimate=lambda path, **_: MemberSize(16 * MIB))
    await pool.start()
    return pool


@pytest.fixture
async def one_model(tmp_path, aiohttp_client, monkeypatch):
    # A model cache without the embedded default: only "only" is on disk.
    monkeypatch.setenv("STRATA_HOME", str(tmp_path / "home"))
    pool = await start_pool(tmp_path, ("only",))
    yield await aiohttp_client(create_app(pool))
    await pool.stop()


@pytest.fixture
async def two_models(tmp_path, aiohttp_client):
    pool = await start_pool(tmp_path, ("first", "second"))
    yield await aiohttp_client(create_app(pool))
    await pool.stop()


def post_paths(client) -> list[str]:
    """Every POST route of the app's router, {slot_id} filled in."""
    paths = {re.sub(r"\{[^}]+\}", "0", route.resource.canonical)
             for route in client.app.router.routes()
             if route.method == "POST" and route.resource is not None}
    return sorted(paths)


def error_message(path: str, answer: dict) -> str:
    """The message of an error answer, checking it has the route's API shape."""
    if path.startswith("/api/"):
        assert set(answer) == {"error"} and isinstance(answer["error"], str), answer
        return answer["error"]
    if path.startswith("/v1/messages"):
        assert answer["type"] == "error" and answer["error"]["type"] == "invalid_request_error"
        return answer["error"]["message"]
    assert answer["error"]["type"] == "invalid_request_error", answer
    return answer["error"]["message"]


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("depth", [100_000, 2_000, MAX_JSON_DEPTH + 1])
async def test_deeply_nested_json_is_a_400_on_every_post_route(two_models, depth):
    paths = post_paths(two_models)
    assert len(paths) >= 30 and "/v1/chat/completions" in paths
    for path in paths:
        raw = f'{{"model": "second", "messages": {nested(depth)}}}'
        response = await two_models.post(path + ("?action=save" if "/slots/" in path else ""),
                                         data=raw, headers={"Content-Type": "application/json"})
        answer = await response.json()
        assert response.status == 400, (path, answer)
        assert "nested" in error_message(path, answer), (path, answer)


async def test_bad_bodies_are_a_400_in_the_routes_shape_on_every_post_route(two_models):
    for path in post_paths(two_models):
        for raw, words in ((b'{"model": "second", ', "not valid JSON"),
                           (b'["model"]', "must be a JSON object"),
                           (b'{"model": "second", "temperature": NaN}', "'temperature' is nan"),
                           (b'{"model": "second", "n": 1e400}', "'n' is inf")):
            response = await two_models.post(path, data=raw)
            answer = await response.json()
            assert response.status == 400, (path, raw, answer)
            assert words in error_message(path, answer), (path, raw, answer)


async def test_nesting_up_to_the_limit_still_reaches_the_handler(two_models):
    raw = f'{{"model": "second", "content": "w5", "x": {nested(MAX_JSON_DEPTH)}}}'
    response = await two_models.post("/tokenize", data=raw)
    assert response.status == 200 and (await response.json())["tokens"] == [5]


async def test_one_model_answers_any_name(one_model):
    response = await one_model.post("/v1/chat/completions", json={
        "model": "gpt-4o-mini", "messages": MESSAGES, "max_tokens": 2})
    answer = await response.json()
    assert response.status == 200, answer
    assert answer["model"] == "only" and answer["choices"][0]["message"]["content"]
    response = await one_model.post("/v1/messages", json={
        "model": "claude-3-5-haiku-latest", "messages": MESSAGES, "max_tokens": 2})
    assert response.status == 200, await response.text()
    response = await one_model.post("/api/chat", json={
        "model": "llama3.2", "messages": MESSAGES, "stream": False,
        "options": {"num_predict": 2}})
    assert response.status == 200, await response.text()


async def test_several_models_keep_the_404_for_an_unknown_name(two_models):
    response = await two_models.post("/v1/chat/completions", json={
        "model": "gpt-4o-mini", "messages": MESSAGES, "max_tokens": 2})
    answer = await response.json()
    assert response.status == 404 and answer["error"]["code"] == "model_not_found", answer
    response = await two_models.post("/v1/chat/completions", json={
        "model": "second", "messages": MESSAGES, "max_tokens": 2})
    assert response.status == 200, await response.text()
