"""Fixtures for the text tests: the real SmolLM2 GGUF, fetched once per session."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def hf_offline():
    """transformers must never reach the hub in tests."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
