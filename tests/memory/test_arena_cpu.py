"""Arena lifecycle on the CPU backend: release gives pages back, refill restores content."""

import psutil
import pytest
import torch
from memory_helpers import MIB, random_bytes

from strata.engine.core.memory import os_pages
from strata.engine.core.memory.arena import (
    Arena,
    ArenaFullError,
    ArenaMapError,
    ArenaReleasedError,
    backend_for,
    cuda_available,
)
from strata.engine.core.memory.arena_set import ArenaSet
from strata.engine.core.memory.cpu_mmap import CpuMmapBackend
from strata.engine.core.memory.host_copy import HostCopy


def test_release_returns_pages_to_the_os(backend):
    if not os_pages.reserve(os_pages.PAGE_SIZE_BYTES).releases_pages:
        pytest.skip("Windows emulation: neither madvise nor VirtualFree here, and the portable "
                    "fallback only zero-fills (tests/memory/test_os_pages.py covers VirtualFree)")
    size = 256 * MIB
    with Arena("experts", size, backend, chunk_bytes=64 * MIB) as arena:
        arena.map()
        arena.tensor(0, (size,), torch.uint8).fill_(7)  # every page really touched
        process = psutil.Process()
        rss_mapped = process.memory_info().rss
        freed = arena.release()
        rss_released = process.memory_info().rss
        assert freed == size
        assert rss_mapped - rss_released >= 0.9 * size, (
            f"RSS fell by {(rss_mapped - rss_released) / MIB:.0f} MiB, expected ~256 MiB"
        )
        assert arena.state == "released" and arena.resident_bytes == 0
        assert arena.released_bytes == size and arena.reserved_bytes == size


def test_refill_restores_identical_content_at_the_same_address(backend):
    arena = Arena("weights", 8 * MIB, backend, chunk_bytes=2 * MIB)
    arena.map()
    weights = arena.allocate((2 * MIB,), torch.float32)  # 8 MiB of float32 = all of it
    content = random_bytes(8 * MIB, seed=1)
    weights.view(torch.uint8).copy_(content)
    address = weights.data_ptr()
    host = HostCopy.snapshot(arena)
    assert not host.is_pinned and host.count_differing_chunks(arena) == 0

    arena.release()
    # The content is really gone: released pages read zeros where the OS lets them be read
    # (on Windows a decommitted page is an access violation; arenas forbid it anyway).
    if arena._reservation.handle.is_readable_when_decommitted:
        assert int(arena._reservation.base_tensor.count_nonzero()) == 0
    result = arena.refill()
    assert result.mapped_bytes == 8 * MIB and result.copied_bytes == 8 * MIB
    assert weights.data_ptr() == address
    assert torch.equal(weights.view(torch.uint8), content)
    assert arena.tensor(0, (2 * MIB,), torch.float32).data_ptr() == address
    arena.close()


def test_views_of_a_released_arena_raise(backend):
    arena = Arena("experts", 4 * MIB, backend)
    arena.map()
    arena.release()
    with pytest.raises(
        ArenaReleasedError, match="arena 'experts' is released: refill it before use"
    ):
        arena.tensor(0, (16,), torch.float16)
    with pytest.raises(ArenaReleasedError):
        arena.allocate((16,), torch.float16)
    with pytest.raises(ArenaReleasedError):
        HostCopy(MIB).copy_to(arena)
    arena.close()
    with pytest.raises(ArenaReleasedError, match="closed"):
        arena.check_mapped()


def test_failed_map_rolls_back_and_a_later_refill_succeeds():
    # Two arenas share one 20 MiB budget: "other" plays another process holding memory.
    backend = CpuMmapBackend(max_resident_bytes=20 * MIB)
    arena = Arena("experts", 16 * MIB, backend, chunk_bytes=2 * MIB)
    arena.map()
    content = random_bytes(16 * MIB, seed=2)
    arena.tensor(0, (16 * MIB,), torch.uint8).copy_(content)
    HostCopy.snapshot(arena)
    arena.release()

    other = Arena("other", 12 * MIB, backend, chunk_bytes=2 * MIB)
    other.map()
    with pytest.raises(ArenaMapError) as failure:
        arena.refill()
    assert failure.value.missing_bytes == 8 * MIB  # 8 MiB fit, 8 MiB did not
    assert "8 MiB missing" in str(failure.value)
    assert arena.state == "released" and arena.resident_bytes == 0
    assert backend.resident_bytes == 12 * MIB  # nothing of the attempt stays mapped

    other.release()
    arena.refill()
    assert torch.equal(arena.tensor(0, (16 * MIB,), torch.uint8), content)


def test_partial_mapping_follows_a_growing_range(backend):
    arena = Arena("kv", 10 * MIB, backend, chunk_bytes=2 * MIB)
    assert arena.ensure_mapped(3 * MIB) == 4 * MIB  # rounded up to whole chunks
    assert arena.state == "partial" and arena.resident_bytes == 4 * MIB
    arena.check_mapped(0, 4 * MIB)
    with pytest.raises(ArenaReleasedError, match=r"bytes \[4194304, 6291456\) are not mapped"):
        arena.tensor(5 * MIB, (8,), torch.float32)
    keys = arena.allocate((10 * MIB // 4,), torch.float32, require_mapped=False)  # full context
    head = random_bytes(3 * MIB, seed=3)
    keys.view(torch.uint8)[: 3 * MIB].copy_(head)

    assert arena.ensure_mapped(9 * MIB) == 6 * MIB
    assert arena.release_from(3 * MIB) == 6 * MIB  # the chunk holding byte 3 MiB stays
    assert arena.resident_bytes == 4 * MIB
    assert torch.equal(keys.view(torch.uint8)[: 3 * MIB], head)
    arena.ensure_mapped(10 * MIB)
    assert arena.state == "mapped"
    assert int(keys.view(torch.uint8)[4 * MIB :].count_nonzero()) == 0
    arena.close()


def test_allocate_aligns_and_refuses_past_the_end(backend):
    arena = Arena("weights", 3 * MIB, backend)
    assert arena.reserved_bytes == 4 * MIB  # rounded up to the 2 MiB granularity
    arena.map()
    a = arena.allocate((3,), torch.float16)
    b = arena.allocate((5,), torch.float32)
    assert b.data_ptr() - a.data_ptr() == 256
    with pytest.raises(ArenaFullError, match="is full"):
        arena.allocate((MIB,), torch.float32)
    with pytest.raises(ValueError, match="not aligned"):
        arena.tensor(2, (4,), torch.float32)
    with pytest.raises(ValueError, match="outside"):
        arena.tensor(4 * MIB - 4, (2,), torch.float32)
    arena.close()


def test_arena_set_accounts_every_arena(backend):
    arenas = ArenaSet()
    weights = arenas.add(Arena("weights", 4 * MIB, backend))
    experts = arenas.add(Arena("experts", 6 * MIB, backend, chunk_bytes=2 * MIB))
    weights.map()
    experts.map()
    experts.release()
    status = arenas.status()
    assert status["arenas"]["weights"]["state"] == "mapped"
    assert status["arenas"]["experts"]["released_bytes"] == 6 * MIB
    assert status["totals"] == {
        "reserved_bytes": 10 * MIB,
        "resident_bytes": 4 * MIB,
        "released_bytes": 6 * MIB,
    }
    with pytest.raises(ValueError, match="already registered"):
        arenas.add(Arena("weights", MIB, backend))
    with pytest.raises(KeyError, match="registered: weights, experts"):
        arenas["kv"]
    assert arenas.release_all() == 4 * MIB
    arenas.close()
    assert len(arenas) == 0 and weights.state == "closed"


def test_backend_choice_without_a_gpu():
    if cuda_available():
        pytest.skip("this machine has CUDA; the no-GPU path is what is tested here")
    assert backend_for("auto").kind == "cpu"
    with pytest.raises(RuntimeError, match="no CUDA driver or GPU"):
        backend_for("cuda")
    with pytest.raises(ValueError, match="unknown device"):
        backend_for("tpu")
