"""Fixtures for the service tests: a tiny tokenizer directory, helpers to drain streams."""

from __future__ import annotations

from pathlib import Path

import pytest
from fakes.tiny_model import write_tiny_model_dir


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return write_tiny_model_dir(tmp_path_factory.mktemp("tiny-model"))


async def drain(events) -> list:
    """Every event of an async iterator, in order."""
    return [event async for event in events]


def token_ids(events) -> list[int]:
    """The generated token ids of a list of events, concatenated."""
    return [t for e in events if hasattr(e, "token_ids") for t in e.token_ids]
