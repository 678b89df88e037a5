"""The kv arena's restore and offload paths on the CPU backend: fill maps and copies region by
region, release_region frees exactly the region it names, and a failed fill leaves nothing."""

from __future__ import annotations

import pytest
import torch

from strata.engine.core.kv_arena import ArenaKVCache, KVArena
from strata.engine.core.memory.arena import ArenaMapError, ArenaReleasedError
from strata.engine.core.memory.cpu_mmap import CpuMmapBackend
from strata.engine.core.random_weights import random_weights_config

MIB = 1 << 20
MAX_TOKENS = 1024
NUM_TOKENS = 300  # not a chunk multiple: the tail of the last chunk must come back zeroed


def make_arena(max_resident_bytes: int | None = None) -> KVArena:
    config = random_weights_config("smollm2-135m")  # 30 layers, 3 kv heads of 64
    backend = CpuMmapBackend(granularity_bytes=64 * 1024, max_resident_bytes=max_resident_bytes)
    return KVArena(config, MAX_TOKENS, torch.float32, backend, num_slots=2)


def snapshot_state(arena: KVArena, num_tokens: int) -> list[torch.Tensor]:
    """Region-order state (k0, v0, k1, ...) where every region holds different values."""
    shape = (num_tokens, arena.config.num_key_value_heads, arena.config.head_dim)
    return [torch.full(shape, float(i + 1)) + torch.rand(shape) for i in range(arena.num_regions)]


def is_mapped(arena: KVArena, region: torch.Tensor) -> bool:
    try:
        arena.arena.check_mapped(region.data_ptr() - arena.arena.base_address, region[:1].nbytes)
    except ArenaReleasedError:
        return False
    return True


def test_fill_puts_each_region_where_the_cache_reads_it() -> None:
    arena = make_arena()
    state = snapshot_state(arena, NUM_TOKENS)
    kv = arena.make_kv(1)
    kv.load_rows(state, NUM_TOKENS)
    assert arena.mapped_tokens(1) >= NUM_TOKENS
    for got, want in zip(kv.regions(), state, strict=True):
        assert torch.equal(got[:NUM_TOKENS], want)
        assert not got[NUM_TOKENS:arena.mapped_tokens(1)].any()  # the rest of the chunk is zero
    assert arena.mapped_tokens(0) == 0  # the other slot was not touched


def test_release_region_frees_exactly_the_region_it_names() -> None:
    arena = make_arena()
    kv = arena.make_kv(0)
    kv.load_rows(snapshot_state(arena, NUM_TOKENS), NUM_TOKENS)
    regions = kv.regions()
    resident_bytes = arena.arena.resident_bytes
    freed_bytes = arena.release_region(0, 3)  # snapshot order: v1
    assert freed_bytes > 0 and arena.arena.resident_bytes == resident_bytes - freed_bytes
    assert [i for i, r in enumerate(regions) if not is_mapped(arena, r)] == [3]
    assert regions[3].data_ptr() == kv.v[1].data_ptr()


def test_a_fill_without_memory_maps_nothing_and_raises() -> None:
    probe = make_arena()
    probe.make_kv(0).load_rows(snapshot_state(probe, NUM_TOKENS), NUM_TOKENS)
    needed_bytes = probe.arena.resident_bytes
    arena = make_arena(max_resident_bytes=needed_bytes // 2)  # runs out halfway through
    kv = ArenaKVCache(arena, 0)
    with pytest.raises(ArenaMapError):
        kv.load_rows(snapshot_state(arena, NUM_TOKENS), NUM_TOKENS)
    assert arena.arena.resident_bytes == 0 and arena.mapped_tokens(0) == 0
    kv.ensure_tokens(8)  # the slot is usable afterwards
    assert arena.mapped_tokens(0) >= 8


def test_fill_refuses_a_slot_that_holds_pages_or_a_wrong_state() -> None:
    arena = make_arena()
    kv = arena.make_kv(0, num_tokens=4)
    with pytest.raises(ValueError, match="must be empty"):
        kv.load_rows(snapshot_state(arena, NUM_TOKENS), NUM_TOKENS)
    arena.release_slot(0)
    with pytest.raises(ValueError, match="regions to fill"):
        kv.load_rows(snapshot_state(arena, NUM_TOKENS)[:-1], NUM_TOKENS)
    assert arena.arena.resident_bytes == 0
