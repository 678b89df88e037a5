"""Shared test setup. Qt must be told to run offscreen before anything imports it."""

import os
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


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
