"""Random release/refill/grow/write/read interleavings against a model of what each byte holds."""

import random

import pytest
import torch
from memory_helpers import random_bytes

from strata.engine.core.memory.arena import Arena, ArenaMapError, ArenaReleasedError
from strata.engine.core.memory.cpu_mmap import CpuMmapBackend
from strata.engine.core.memory.host_copy import HostCopy

CHUNK = 256 * 1024  # small chunks on a 64 KiB-granular backend keep 250 steps fast
SIZE = 8 * CHUNK
NUM_CHUNKS = SIZE // CHUNK


def _check(arena: Arena, expected: torch.Tensor, mapped: set[int]) -> None:
    for i in range(NUM_CHUNKS):
        if i in mapped:
            got = arena.tensor(i * CHUNK, (CHUNK,), torch.uint8)
            assert torch.equal(got, expected[i * CHUNK : (i + 1) * CHUNK]), f"chunk {i} differs"
        else:
            with pytest.raises(ArenaReleasedError):
                arena.tensor(i * CHUNK, (CHUNK,), torch.uint8)
    assert arena.resident_bytes == len(mapped) * CHUNK


@pytest.mark.parametrize("seed", range(5))
def test_fifty_random_operations_keep_content_right(seed):
    rng = random.Random(seed)
    backend = CpuMmapBackend(granularity_bytes=64 * 1024)
    arena = Arena("kv", SIZE, backend, chunk_bytes=CHUNK)
    host = HostCopy(SIZE)
    arena.attach_host_copy(host)
    expected = torch.zeros(SIZE, dtype=torch.uint8)  # what the mapped chunks must read
    mirror = torch.zeros(SIZE, dtype=torch.uint8)  # what the host copy holds
    mapped: set[int] = set()
    for step in range(50):
        op = rng.choice(["write", "release", "release_from", "refill", "grow", "squeeze"])
        if op == "write" and mapped:
            i = rng.choice(sorted(mapped))
            data = random_bytes(CHUNK, seed=seed * 1000 + step)
            arena.tensor(i * CHUNK, (CHUNK,), torch.uint8).copy_(data)
            host.copy_from(arena, i * CHUNK, CHUNK)  # keep the mirror current, as offload does
            expected[i * CHUNK : (i + 1) * CHUNK] = data
            mirror[i * CHUNK : (i + 1) * CHUNK] = data
        elif op == "release":
            assert arena.release() == len(mapped) * CHUNK
            mapped.clear()
        elif op == "release_from":
            offset = rng.randrange(SIZE)
            first = -(-offset // CHUNK)
            gone = {i for i in mapped if i >= first}
            assert arena.release_from(offset) == len(gone) * CHUNK
            mapped -= gone
        elif op == "refill":
            newly = set(range(NUM_CHUNKS)) - mapped
            arena.refill()
            for i in newly:  # refilled chunks come back from the host copy
                expected[i * CHUNK : (i + 1) * CHUNK] = mirror[i * CHUNK : (i + 1) * CHUNK]
            mapped = set(range(NUM_CHUNKS))
        elif op == "grow":
            up_to = rng.randrange(1, SIZE + 1)
            newly = set(range(-(-up_to // CHUNK))) - mapped
            arena.ensure_mapped(up_to)
            for i in newly:  # freshly mapped CPU pages read zeros
                expected[i * CHUNK : (i + 1) * CHUNK] = 0
            mapped |= newly
        elif op == "squeeze" and len(mapped) < NUM_CHUNKS - 1:
            # Another process leaves room for one chunk only: the refill must fail and roll back.
            backend.max_resident_bytes = backend.resident_bytes + CHUNK
            with pytest.raises(ArenaMapError) as failure:
                arena.refill()
            missing = (NUM_CHUNKS - len(mapped) - 1) * CHUNK
            assert failure.value.missing_bytes == missing
            backend.max_resident_bytes = None
        _check(arena, expected, mapped)
    arena.close()
