"""Fixtures of the snapshot tests: two tiny llamas (same shape, other weights), a cold engine."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.snapshots.helpers import ColdRunner, make_engine, save_tiny_llama


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("llama_a"), seed=0)


@pytest.fixture(scope="session")
def other_model_dir(tmp_path_factory) -> Path:
    """Same shape and file sizes as model_dir, other weights: only the fingerprint tells."""
    return save_tiny_llama(tmp_path_factory.mktemp("llama_b"), seed=1)


@pytest.fixture(scope="session")
def cold(model_dir, tmp_path_factory) -> ColdRunner:
    return ColdRunner(make_engine(model_dir, tmp_path_factory.mktemp("cold_snapshots")))
