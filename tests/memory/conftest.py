"""Fixtures for the CPU arena tests: small arenas on the mmap backend."""

import pytest

from strata.engine.core.memory.cpu_mmap import CpuMmapBackend


@pytest.fixture
def backend() -> CpuMmapBackend:
    return CpuMmapBackend()
