"""Tokenizing and chat templates run off the event loop (issue 17 item 6): /health and /v1/status
keep answering while a 3 MiB /tokenize is tokenized with the default model's real tokenizer.
Request bodies past the limit get a 413 that names it."""

from __future__ import annotations

import asyncio
import json

import pytest

from strata.default_model import DefaultModelError, default_model_path
from strata.engine.api import create_app
from strata.engine.api.app import MAX_REQUEST_BYTES
from strata.engine.text import load_text_assets

from .fake_service import FakeService

pytestmark = pytest.mark.timeout(180)
TEXT_BYTES = 3 * 1024 * 1024  # a few seconds of tokenizing on CI's 2 cores


class ObservedService(FakeService):
    """Sets `assets_read` when a route takes the tokenizer: the tokenize handler has parsed
    its body and is about to tokenize."""

    def __init__(self, text):
        super().__init__(text)
        self._assets = text
        self.assets_read = asyncio.Event()

    @property
    def text(self):
        self.assets_read.set()
        return self._assets

    @text.setter
    def text(self, value):
        self._assets = value


@pytest.fixture(scope="module")
def real_assets():
    try:
        return load_text_assets(default_model_path(fetch=False))
    except DefaultModelError as exc:
        pytest.skip(str(exc))


@pytest.mark.parametrize("route", ["/tokenize", "/v1/messages/count_tokens"])
async def test_status_routes_answer_while_a_huge_prompt_is_tokenized(aiohttp_client, real_assets,
                                                                     route):
    service = ObservedService(real_assets)
    client = await aiohttp_client(create_app(service))
    text = ("The quick brown fox jumps over the lazy dog, again and again. " * 60_000)
    text = text[:TEXT_BYTES]
    payload = {"content": text} if route == "/tokenize" else {
        "messages": [{"role": "user", "content": text}]}  # the chat template, then tokenizing
    tokenize = asyncio.create_task(client.post(
        route, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"}))
    # Tokenizing on the event loop would keep us from running again until it has finished.
    await asyncio.wait_for(service.assets_read.wait(), 60)
    answered = []
    for status_route in ("/health", "/v1/status", "/health", "/v1/status"):
        resp = await client.get(status_route)
        assert resp.status == 200, status_route
        await resp.read()
        answered.append((status_route, tokenize.done()))
    assert not any(done for _, done in answered), answered
    resp = await tokenize
    assert resp.status == 200
    answer = await resp.json()
    num_tokens = len(answer["tokens"]) if route == "/tokenize" else answer["input_tokens"]
    assert num_tokens > 300_000


async def test_a_body_past_the_limit_is_a_413_naming_it(client):
    resp = await client.post("/tokenize", data=b"x" * (MAX_REQUEST_BYTES + 1),
                             headers={"Content-Type": "application/json"})
    assert resp.status == 413
    error = (await resp.json())["error"]
    assert f"{MAX_REQUEST_BYTES // (1024 * 1024)} MiB limit" in error["message"]
    assert error["code"] == "request_too_large"
