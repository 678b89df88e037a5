"""Fixtures for the API tests: real tiny tokenizer, fake service, the real aiohttp app."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from strata.engine.api import create_app
from strata.engine.text import load_text_assets

from .fake_service import FakeService
from .tiny_text import write_tiny_model_dir


@pytest.fixture(scope="session")
def text_assets(tmp_path_factory):
    return load_text_assets(write_tiny_model_dir(tmp_path_factory.mktemp("tiny-model")))


@pytest.fixture
def service(text_assets) -> FakeService:
    return FakeService(text_assets)


@pytest.fixture
async def client(aiohttp_client, service):
    return await aiohttp_client(create_app(service))


@pytest.fixture
def make_client(aiohttp_client, service) -> Callable:
    """A client over an app built with custom create_app options."""
    async def make(**options: Any):
        return await aiohttp_client(create_app(service, **options))
    return make


def parse_sse(body: str) -> list[tuple[str | None, Any]]:
    """Split an event stream into (event name, data) pairs; data is JSON or '[DONE]'."""
    events = []
    for block in body.split("\n\n"):
        if not block.strip():
            continue
        name, data_lines = None, []
        for line in block.split("\n"):
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                data_lines.append(line[len("data: "):])
        data = "\n".join(data_lines)
        events.append((name, data if data == "[DONE]" else json.loads(data)))
    return events
