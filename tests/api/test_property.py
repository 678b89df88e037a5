"""Random JSON bodies and random bytes to every POST route never produce a 5xx."""

from __future__ import annotations

import asyncio
import http.client
import json
import threading

import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from strata.engine.api import create_app

from .fake_service import FakeService

POST_PATHS = ["/v1/chat/completions", "/v1/completions", "/v1/messages",
              "/v1/messages/count_tokens", "/tokenize", "/detokenize", "/load", "/unload",
              "/sleep", "/wake", "/cache/release", "/cache/refill", "/session/offload",
              "/slots/0?action=save", "/slots/1?action=restore", "/slots/2?action=erase"]
KEYS = ["messages", "role", "content", "type", "text", "prompt", "max_tokens",
        "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
        "stop_sequences", "stream", "stream_options", "include_usage", "n", "system",
        "strata_cache_slot", "id_slot", "tokens", "add_special", "with_pieces", "filename"]

scalars = (st.none() | st.booleans() | st.integers(-2**70, 2**70)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12)
           | st.sampled_from(["user", "assistant", "system", "text", "hi", "../x", "a.bin"]))
values = st.recursive(scalars, lambda children: st.lists(children, max_size=4)
                      | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=6), children,
                                        max_size=5), max_leaves=20)
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]),
                                 "content": values})
bodies = st.dictionaries(st.sampled_from(KEYS), values | st.lists(message, max_size=3),
                         max_size=8)


@pytest.fixture(scope="module")
def live_server(tmp_path_factory):
    """The app on a real port, served by its own loop in a thread (hypothesis drives it)."""
    from strata.engine.text import load_text_assets

    from .tiny_text import write_tiny_model_dir

    assets = load_text_assets(write_tiny_model_dir(tmp_path_factory.mktemp("prop-model")))
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(create_app(FakeService(assets, context_tokens=256)))
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = runner.addresses[0][1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield port
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=10)
    loop.close()


def _post(port: int, path: str, payload: bytes) -> tuple[int, str, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("POST", path, body=payload, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.getheader("Content-Type", ""), resp.read()
    finally:
        conn.close()


def _check(status: int, content_type: str, raw: bytes) -> None:
    assert status < 500, raw[:300]
    if status >= 400:
        body = json.loads(raw)
        assert "error" in body and isinstance(body["error"]["message"], str)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(path=st.sampled_from(POST_PATHS), body=bodies)
def test_random_json_bodies_never_give_5xx(live_server, path, body):
    _check(*_post(live_server, path, json.dumps(body).encode()))


@settings(max_examples=80, deadline=None)
@given(path=st.sampled_from(POST_PATHS), payload=st.binary(max_size=64))
def test_random_bytes_never_give_5xx(live_server, path, payload):
    _check(*_post(live_server, path, payload))


def test_server_still_answers_after_the_fuzzing(live_server):
    conn = http.client.HTTPConnection("127.0.0.1", live_server, timeout=10)
    conn.request("GET", "/health")
    assert conn.getresponse().status == 200
