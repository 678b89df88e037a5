"""The expert cache's VRAM accounting under a budget (issue 54, run 33b: 0.81 and 1.31 GiB
over 12 and 8 GiB): the slot arena maps whole chunks per class and projection, so a budget's
slot count must come from what the arena keeps mapped, not slots x bytes per expert."""

import pytest
import torch

from strata.engine.core.memory.cpu_mmap import CpuMmapBackend
from strata.engine.core.memory.expert_store import ExpertStore
from strata.engine.core.memory.os_pages import PAGE_SIZE_BYTES

E, INTER, HIDDEN = 8, 64, 32  # one projection of one expert: 4 KiB in bf16


def _store(chunk_bytes: int) -> ExpertStore:
    g = torch.Generator().manual_seed(5)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(torch.bfloat16)

    layers = {layer: (rand(E, INTER, HIDDEN), rand(E, INTER, HIDDEN), rand(E, HIDDEN, INTER))
              for layer in range(6)}
    return ExpertStore(layers, num_slots=48, backend=CpuMmapBackend(PAGE_SIZE_BYTES),
                       chunk_bytes=chunk_bytes)


def test_slots_within_a_budget_keep_the_mapped_bytes_inside_it():
    chunk_bytes = 3 * INTER * HIDDEN * 2  # three slots of one projection a chunk: unaligned
    if chunk_bytes % PAGE_SIZE_BYTES:
        pytest.skip(f"a {chunk_bytes}-byte chunk is not whole {PAGE_SIZE_BYTES}-byte pages")
    store = _store(chunk_bytes)
    try:
        full = store.arena.resident_bytes
        # Exact: what the arena maps after each resize (from any count) is mapped_bytes_at.
        for num_slots in (47, 30, 13, 8, 29, 48, 20):
            store.resize(num_slots)
            assert store.arena.resident_bytes == store.mapped_bytes_at(num_slots), num_slots
        store.resize(48)
        assert store.arena.resident_bytes == full == store.mapped_bytes_at(48)
        for budget in (full - 1, 30 * store.bytes_per_expert, 20 * store.bytes_per_expert + 7):
            naive = budget // store.bytes_per_expert  # the old sizing: over the budget
            assert store.mapped_bytes_at(naive) > budget
            fits = store.slots_within(budget)
            assert fits < naive and store.mapped_bytes_at(fits) <= budget
            assert store.mapped_bytes_at(fits + 1) > budget  # the most that fit
            store.resize(fits)
            assert store.arena.resident_bytes <= budget
            store.resize(48)
        assert store.slots_within(full) == 48 and store.slots_within(0) == E  # the floor
    finally:
        store.close()
