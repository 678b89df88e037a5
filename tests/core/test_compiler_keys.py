"""A standby computes torch.compile's and Triton's source hashes ahead of a load
(fast/compiler_keys.py), into those libraries' own caches, without a CUDA context."""

from __future__ import annotations

import pytest
import torch

from strata.engine.core.fast import compiler_keys

triton = pytest.importorskip("triton")


def test_the_keys_land_in_the_libraries_own_caches() -> None:
    from torch._inductor.codecache import torch_key
    from triton.runtime.cache import triton_key

    assert compiler_keys.warm_compiler_keys() == ["torch_key", "triton_key"]
    assert triton_key.cache_info().currsize == 1  # the load's first kernel finds it
    with pytest.raises(RuntimeError, match="already set"):
        torch_key.set(b"")  # set only where nothing was computed yet
    assert not torch.cuda.is_initialized()


def test_a_key_this_version_cannot_compute_is_skipped(monkeypatch) -> None:
    def missing() -> None:
        raise ImportError("cannot import name 'torch_key'")

    monkeypatch.setattr(compiler_keys, "_torch_key", missing)
    assert compiler_keys.warm_compiler_keys() == ["triton_key"]
