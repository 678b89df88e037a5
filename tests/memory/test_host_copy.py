"""HostCopy on the CPU backend: chunked copies, stats, views, pinning refused without CUDA."""

import pytest
import torch
from memory_helpers import MIB, random_bytes

from strata.engine.core.memory.arena import Arena, cuda_available
from strata.engine.core.memory.host_copy import HostCopy, copy_chunked


def test_copies_round_trip_in_chunks_larger_than_one(backend):
    arena = Arena("weights", 40 * MIB, backend, chunk_bytes=8 * MIB)
    arena.map()
    host = HostCopy(40 * MIB)
    content = random_bytes(40 * MIB, seed=4)
    host.tensor(0, (40 * MIB,), torch.uint8).copy_(content)
    stats = host.copy_to(arena)  # 64 MiB chunks would be one copy; use 16 MiB below too
    assert stats.nbytes == 40 * MIB and stats.seconds > 0 and stats.gb_per_s > 0
    assert torch.equal(arena.tensor(0, (40 * MIB,), torch.uint8), content)

    other = HostCopy(40 * MIB)
    copy_chunked(
        other.tensor(0, (40 * MIB,), torch.uint8),
        arena.tensor(0, (40 * MIB,), torch.uint8),
        chunk_bytes=16 * MIB,
    )  # three chunks, the last one partial
    assert other.count_differing_chunks(arena, chunk_bytes=16 * MIB) == 0
    arena.tensor(39 * MIB, (1,), torch.uint8).add_(1)
    assert other.count_differing_chunks(arena, chunk_bytes=16 * MIB) == 1
    with pytest.raises(ValueError, match="16 MiB minimum"):
        copy_chunked(other.tensor(0, (8,), torch.uint8), content[:8], chunk_bytes=MIB)
    arena.close()
    host.close()
    other.close()
    host.close()  # twice is harmless


def test_views_are_checked(backend):
    host = HostCopy(MIB)
    assert host.tensor(8, (4,), torch.float16).shape == (4,)
    with pytest.raises(ValueError, match="outside"):
        host.tensor(MIB - 2, (2,), torch.float16)
    with pytest.raises(ValueError, match="misaligned"):
        host.tensor(1, (2,), torch.float16)


def test_pinning_without_cuda_stays_pageable_and_says_why():
    if cuda_available():
        pytest.skip("CUDA is present here; tests/gpu covers pinning")
    host = HostCopy(MIB)
    assert host.pin() is False
    assert not host.is_pinned and "no CUDA" in host.pin_note
