"""ExpertStore on the CPU backend: fetch returns the right experts, release/refill round-trips."""

import pytest
import torch

from strata.engine.core.memory.arena import ArenaReleasedError
from strata.engine.core.memory.expert_layout import contiguous_runs
from strata.engine.core.memory.expert_store import ExpertStore

E, INTER, HIDDEN = 8, 16, 12


def _layers(num_layers=2, seed=0):
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float32).to(torch.bfloat16)

    return {
        layer: (rand(E, INTER, HIDDEN), rand(E, INTER, HIDDEN), rand(E, HIDDEN, INTER))
        for layer in range(num_layers)
    }


def test_fetch_returns_the_requested_experts_and_evicts_lru(backend):
    layers = _layers()
    store = ExpertStore(layers, num_slots=5, backend=backend)
    assert store.bytes_per_expert == 3 * INTER * HIDDEN * 2
    assert store.cache.num_resident == 5 and not store.is_all_resident  # preloaded
    hits_before = store.cache.num_hits
    gate, up, down = store.fetch(0, torch.tensor([[3], [1]]))
    assert torch.equal(gate, layers[0][0][[3, 1]])
    assert torch.equal(up, layers[0][1][[3, 1]]) and torch.equal(down, layers[0][2][[3, 1]])
    assert store.cache.num_hits == hits_before + 2
    gate, _, down = store.fetch(1, [7, 6])  # misses: evict layer-0 slots and copy in
    assert torch.equal(gate, layers[1][0][[7, 6]]) and torch.equal(down, layers[1][2][[7, 6]])
    assert store.cache.num_evictions == 2
    slots = store.fetch_slots(1, [6])
    assert torch.equal(store.slot_weights[1][slots[0]], layers[1][1][6])
    with pytest.raises(ValueError, match="no experts"):
        store.fetch(5, [0])
    store.close()


def test_release_then_refill_restores_residency_and_content(backend, monkeypatch):
    layers = _layers(seed=1)
    store = ExpertStore(layers, num_slots=6, backend=backend)
    store.fetch(1, [5, 2])
    resident = store.cache.resident()
    freed = store.release()
    assert freed == store.arena.reserved_bytes and store.arena.state == "released"
    with pytest.raises(ArenaReleasedError, match="'experts' is released"):
        store.fetch(0, [0])

    monkeypatch.setenv("STRATA_VERIFY_REFILL", "1")
    result = store.refill()
    assert result.differing_slots == 0
    assert result.copied_bytes == len(resident) * store.bytes_per_expert
    assert store.cache.resident() == resident
    misses = store.cache.num_misses
    gate, _, _ = store.fetch(1, [2, 5])
    assert store.cache.num_misses == misses and torch.equal(gate, layers[1][0][[2, 5]])

    # The verification is real: a corrupted slot is counted.
    store.slot_weights[2][store.cache.slot_of(1, 5)].zero_()
    assert store.verify_slots() == 1
    store.close()


def test_all_experts_resident_never_miss(backend):
    layers = _layers(num_layers=3)
    store = ExpertStore(layers, num_slots=1000, backend=backend)
    assert store.num_slots == 3 * E and store.is_all_resident
    misses = store.cache.num_misses
    for layer in range(3):
        gate, _, _ = store.fetch(layer, list(range(E)))
        assert torch.equal(gate, layers[layer][0])
    assert store.cache.num_misses == misses and store.cache.num_evictions == 0
    store.close()


def test_inconsistent_expert_shapes_are_refused(backend):
    layers = _layers()
    gate, up, down = layers[1]
    layers[1] = (gate, up, down[:, :, :-1])
    with pytest.raises(ValueError, match="layer 1: experts must all be"):
        ExpertStore(layers, num_slots=4, backend=backend)


def test_consecutive_experts_in_consecutive_slots_copy_as_one_run():
    assert contiguous_runs([(0, 2, 5), (0, 0, 3), (0, 1, 4), (1, 3, 6), (1, 4, 9), (0, 3, 7)]) == [
        (0, 0, 3, 3),  # experts 0-2 into slots 3-5
        (0, 3, 7, 1),  # the next expert, but not the next slot
        (1, 3, 6, 1),
        (1, 4, 9, 1),
    ]
    assert contiguous_runs([]) == []


def test_an_all_resident_refill_restores_every_expert(backend, monkeypatch):
    layers = _layers(num_layers=3, seed=2)
    store = ExpertStore(layers, num_slots=1000, backend=backend)
    store.release()
    monkeypatch.setenv("STRATA_VERIFY_REFILL", "1")
    result = store.refill()
    assert result.differing_slots == 0 and result.copied_bytes == 3 * E * store.bytes_per_expert
    for layer in range(3):
        fetched = store.fetch(layer, list(range(E)))
        assert all(torch.equal(got, want) for got, want in zip(fetched, layers[layer], strict=True))
    store.close()


def test_shrinking_in_steps_frees_what_one_step_frees_and_grows_back_whole() -> None:
    """shrink_experts resizes a few times until enough VRAM is free (expert_shrink.py). The
    arena frees whole chunks, so each step must free every chunk past the new count, also
    those that straddled an earlier count: a 4-layer game scenario on the H200 freed 0.5 of
    the 1.3 GiB it needed when each step freed only its own slots (run 25d)."""
    from strata.engine.core.memory.cpu_mmap import CpuMmapBackend
    from strata.engine.core.memory.os_pages import PAGE_SIZE_BYTES

    inter, hidden = 64, 32  # a projection of one expert: 4 KiB, a page on most systems
    chunk_bytes = 4 * inter * hidden * 2  # four slots of one projection a chunk
    if chunk_bytes % PAGE_SIZE_BYTES:
        pytest.skip(f"a {chunk_bytes}-byte chunk is not whole {PAGE_SIZE_BYTES}-byte pages")
    g = torch.Generator().manual_seed(3)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(torch.bfloat16)

    layers = {layer: (rand(E, inter, hidden), rand(E, inter, hidden), rand(E, hidden, inter))
              for layer in range(4)}

    def store_of() -> ExpertStore:
        return ExpertStore(layers, num_slots=28, backend=CpuMmapBackend(PAGE_SIZE_BYTES),
                           chunk_bytes=chunk_bytes)

    at_once, stepped = store_of(), store_of()
    reserved = at_once.arena.resident_bytes
    freed_at_once = at_once.resize(8)["freed_bytes"]
    freed_stepped = sum(stepped.resize(n)["freed_bytes"] for n in range(27, 7, -1))
    assert freed_at_once > 0 and freed_stepped == freed_at_once
    assert stepped.arena.resident_bytes == at_once.arena.resident_bytes == reserved - freed_at_once
    assert stepped.num_slots == 8
    grown = stepped.resize(28)
    assert grown["mapped_bytes"] == freed_at_once and stepped.arena.resident_bytes == reserved
    for layer, (gate, up, down) in layers.items():  # every expert again, misses from host
        got = stepped.fetch(layer, list(range(E)))
        assert all(torch.equal(a, b) for a, b in zip(got, (gate, up, down)))
    at_once.close()
    stepped.close()


def test_update_table_publishes_as_the_torch_formula_it_replaced(backend):
    """update_table (numpy since session 38) against the torch statement of what it does:
    entries at the given slots cleared first (a few slots, and more than 16: isin), then
    the new entries; the device table holds them class-local (the cache's number less the
    layer's class base: set here as classes of other sizes would, float experts having
    one class)."""
    store = ExpertStore(_layers(3), num_slots=16, backend=backend)
    store._layer_base = torch.tensor([[0], [0], [6]], dtype=torch.int32)
    g = torch.Generator().manual_seed(1)
    try:
        for round_ in range(40):
            published = store.table_mirror  # a step's table: replaced, never written
            before = published.clone()
            num_cleared = [0, 3, 20][round_ % 3]
            cleared = torch.randperm(16, generator=g)[:num_cleared].tolist()
            resident = (before >= 0).nonzero().tolist()
            entries = [(layer, expert, int(before[layer, expert]))
                       for layer, expert in resident[: round_ % 4]]
            want = before.clone()
            slots = [*cleared, *(slot for _, _, slot in entries)]
            if slots:
                want[torch.isin(want, torch.tensor(slots, dtype=torch.int32))] = -1
            for layer, expert, slot in entries:
                want[layer, expert] = slot
            store.update_table(cleared_slots=cleared, entries=entries)
            assert torch.equal(store.table_mirror, want)
            local = torch.where(want >= 0, want - store._layer_base, -1).to(torch.int32)
            assert torch.equal(store.table.cpu(), local)
            assert torch.equal(published, before)
    finally:
        store.close()
