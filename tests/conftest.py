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


@pytest.fixture
def counted_paths(monkeypatch):
    """{"gemm": calls, "grouped": calls} of the two quantized prefill paths (imported here, at
    test time: after a CPU test module has chosen Triton's interpreter)."""
    from strata.engine.core.quant import expert_gemm, expert_grouped

    calls = {"gemm": 0, "grouped": 0}
    for name, module in (("gemm", expert_gemm), ("grouped", expert_grouped)):
        def counted(*args, _name=name, _fn=module.experts_mlp, **kwargs):
            calls[_name] += 1
            return _fn(*args, **kwargs)
        monkeypatch.setattr(module, "experts_mlp", counted)
    return calls
