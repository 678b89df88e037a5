"""Fixtures for the text tests: the real SmolLM2 GGUF, fetched once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from strata.default_model import DefaultModelError, default_model_path
from strata.engine.text import TextAssets, load_text_assets


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The embedded default model from the model cache ($STRATA_HOME honoured), pulled if absent."""
    try:
        return default_model_path(fetch=True, progress=False)
    except DefaultModelError as exc:
        pytest.skip(f"SmolLM2 GGUF download failed, cannot test against it: {exc}")


@pytest.fixture(scope="session")
def smollm2(smollm2_gguf: Path) -> TextAssets:
    return load_text_assets(smollm2_gguf)


@pytest.fixture(scope="session")
def hf_offline():
    """transformers must never reach the hub in tests."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
