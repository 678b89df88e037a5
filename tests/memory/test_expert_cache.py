"""ExpertCache residency table: LRU order (the lfu policy: test_expert_policy.py), hit/miss
counters, release/restore; size_slots."""

import pytest

from strata.engine.core.memory.expert_cache import ExpertCache, ExpertCacheReleasedError, size_slots

MIB = 1 << 20


def test_misses_fill_free_slots_then_hits_reuse_them():
    cache = ExpertCache(num_layers=2, num_experts=8, num_slots=4)
    slots, misses = cache.lookup(0, [5, 2])
    assert slots == [0, 1] and misses == [(5, 0), (2, 1)]
    slots, misses = cache.lookup(0, [2, 5, 2])
    assert slots == [1, 0, 1] and misses == []
    assert (cache.num_hits, cache.num_misses) == (2, 2)
    assert cache.slot_of(0, 5) == 0 and cache.slot_of(1, 5) is None


def test_least_recently_used_is_evicted_never_one_of_the_same_step():
    cache = ExpertCache(num_layers=1, num_experts=8, num_slots=3, policy="lru")
    cache.lookup(0, [0, 1, 2])
    cache.lookup(0, [0])  # 1 is now the least recently used
    _, misses = cache.lookup(0, [3])
    assert misses == [(3, 1)] and cache.slot_of(0, 1) is None and cache.num_evictions == 1
    # 2 is oldest, but it is part of this step, so 0 goes instead
    _, misses = cache.lookup(0, [2, 4])
    assert cache.slot_of(0, 2) == 2 and misses == [(4, 0)]
    assert [(e, s) for _, e, s in cache.resident()] == [(3, 1), (2, 2), (4, 0)]


def test_a_step_needing_more_experts_than_slots_is_refused():
    cache = ExpertCache(num_layers=1, num_experts=8, num_slots=2)
    with pytest.raises(ValueError, match="needs 3 experts but the cache has 2 slots"):
        cache.lookup(0, [1, 2, 3])
    with pytest.raises(ValueError, match=r"expert ids \[9\]"):
        cache.lookup(0, [9])
    with pytest.raises(ValueError, match="layer 1"):
        cache.lookup(1, [0])


def test_release_forgets_then_restores_the_same_residency():
    cache = ExpertCache(num_layers=2, num_experts=4, num_slots=4)
    cache.lookup(0, [1])
    cache.lookup(1, [3, 0])
    before = cache.resident()
    cache.mark_all_released()
    cache.mark_all_released()  # twice keeps the first memory
    assert cache.num_resident == 0 and cache.is_released
    with pytest.raises(ExpertCacheReleasedError, match="released"):
        cache.lookup(0, [1])
    assert cache.restore_residency() == before
    assert cache.resident() == before and cache.restore_residency() == []
    slots, misses = cache.lookup(1, [0, 3])
    assert misses == [] and slots == [cache.slot_of(1, 0), cache.slot_of(1, 3)]
    _, misses = cache.lookup(0, [2])  # the free slot left is handed out, nothing evicted
    assert cache.num_evictions == 0 and misses[0][1] not in {s for _, _, s in before}
    assert cache.stats()["hit_rate"] == pytest.approx(2 / 6)


def test_size_slots_specs():
    per_expert = 10 * MIB
    assert (
        size_slots(
            "auto", per_expert, free_bytes=1000 * MIB, reserve_bytes=200 * MIB, total_experts=1000
        )
        == 80
    )
    assert size_slots("auto", per_expert, 100_000 * MIB, 0, total_experts=64) == 64  # all fit
    assert size_slots("all", per_expert, 0, 0, total_experts=64) == 64
    assert size_slots(12, per_expert, 0, 0, total_experts=64) == 12
    assert size_slots("100", per_expert, 0, 0, total_experts=64) == 64
    assert size_slots("205MiB", per_expert, 0, 0, total_experts=64) == 20
    assert size_slots("1GiB", per_expert, 0, 0, total_experts=640) == 102
    with pytest.raises(ValueError, match="fewer than the 8 needed; free VRAM"):
        size_slots("auto", per_expert, 100 * MIB, 60 * MIB, total_experts=64, min_slots=8)
    with pytest.raises(ValueError, match="not understood"):
        size_slots("lots", per_expert, 0, 0, total_experts=64)


def test_pools_evict_within_their_layers_and_share_a_resize_by_layers():
    """Slot classes (ExpertStore): layers 0 and 2 share slots 0..5, layer 1 has 6..9; a miss
    evicts only in its own pool, and a resize splits the slots by the pools' layers."""
    cache = ExpertCache(num_layers=4, num_experts=4, num_slots=10,
                        pools=[([0, 2], 6), ([1], 4)])
    assert cache.bases == [0, 6] and cache.pool_slots(2) == 6 and cache.pool_slots(1) == 4
    assert cache.lookup(0, [0, 1, 2, 3])[0] == [0, 1, 2, 3]
    assert cache.lookup(1, [3, 2, 1, 0])[0] == [6, 7, 8, 9]  # pool 0's free slots untouched
    assert cache.lookup(2, [0, 1])[0] == [4, 5]
    _, misses = cache.lookup(2, [2])  # pool 0 is full: its least recently used, (0, 0), goes
    assert misses == [(2, 0)] and cache.slot_of(0, 0) is None and cache.num_evictions == 1
    assert all(cache.slot_of(1, e) is not None for e in range(4))
    with pytest.raises(ValueError, match="layer 3 has no slots"):
        cache.lookup(3, [0])

    assert cache.pool_sizes(7) == [4, 4]  # 7 * 2 // 3 = 4 for two layers, at least 4 for one
    evicted = cache.resize(7)
    assert sorted(evicted) == [4, 5] and cache.num_slots == 8
    assert cache.slot_of(2, 0) is None and cache.slot_of(2, 1) is None
    before = cache.resident()
    cache.mark_all_released()
    assert cache.restore_residency() == before
    _, misses = cache.lookup(2, [3])  # pool 0 uses slots 0..3 now: an eviction, not slot 4
    assert misses[0][1] < 4
    cache.resize(10)
    assert cache.pool_sizes(10) == [6, 4] and cache.num_slots == 10


def test_pools_that_do_not_add_up_are_refused():
    with pytest.raises(ValueError, match="not num_slots=9"):
        ExpertCache(num_layers=2, num_experts=4, num_slots=9, pools=[([0], 4), ([1], 4)])
    with pytest.raises(ValueError, match="in two pools"):
        ExpertCache(num_layers=2, num_experts=4, num_slots=8, pools=[([0], 4), ([0], 4)])


def test_a_prefetch_takes_the_lowest_counts_keeps_what_is_in_use_and_counts_no_use():
    cache = ExpertCache(num_layers=2, num_experts=8, num_slots=4)
    cache.lookup(0, [0, 1])
    cache.lookup(0, [0, 1])
    cache.lookup(0, [2, 3])  # 0 and 1 used twice, 2 and 3 once
    hits, misses = cache.num_hits, cache.num_misses
    # Layer 1's guess: 3 goes (2 is kept: this step's layer uses it), then 0 or 1 (the
    # lowest counts left outside the kept and the guess).
    taken = cache.take_for_prefetch(1, [5, 6], keep=[(0, 2)])
    assert [expert for expert, _ in taken] == [5, 6]
    assert cache.slot_of(0, 3) is None and cache.slot_of(0, 2) is not None
    assert [cache.slot_of(0, e) is None for e in (0, 1)].count(True) == 1
    assert {cache.slot_of(1, 5), cache.slot_of(1, 6)} == {slot for _, slot in taken}
    assert (cache.num_hits, cache.num_misses, cache.num_prefetched) == (hits, misses, 2)
    assert cache.use_count(1, 5) == 0.0  # a guess is not a use: the next victim
    assert cache.take_for_prefetch(1, [6]) == []  # resident: nothing to copy
    # Only the kept and the guessed are left: a prefetch stops instead of evicting them.
    resident = [(layer, expert) for layer, expert, _ in cache.resident()]
    assert cache.take_for_prefetch(1, [7], keep=resident) == []
    with pytest.raises(ValueError, match=r"outside 0\.\.7"):
        cache.take_for_prefetch(1, [8])
    cache.mark_all_released()
    with pytest.raises(ExpertCacheReleasedError):
        cache.take_for_prefetch(1, [7])


def test_a_grown_cache_fills_its_free_slots_with_the_most_used_experts_first():
    cache = ExpertCache(num_layers=2, num_experts=4, num_slots=8)
    cache.lookup(0, [0, 1, 2, 3])
    cache.lookup(1, [0, 1, 2, 3])
    for _ in range(3):  # layer 1's 2 and layer 0's 3 are the most used
        cache.lookup(1, [2])
    cache.lookup(0, [3])
    cache.resize(3)  # three slots: layer 0's 0, 1, 2 stay
    assert cache.num_free == 0 and cache.num_resident == 3
    cache.resize(8)
    assert cache.num_free == 5 and cache.stats()["num_free_slots"] == 5
    evictions, hits, misses = cache.num_evictions, cache.num_hits, cache.num_misses

    first = cache.fill_free(2)
    # The two most used that are not resident, in (layer, expert) order, ascending slots.
    assert first == [(0, 3, 3), (1, 2, 4)]
    rest = cache.fill_free(10)  # more than there is room for: the free slots only
    assert sorted(rest) == rest and [s for _, _, s in rest] == [5, 6, 7]
    assert {(layer, expert) for layer, expert, _ in rest} == {(1, 0), (1, 1), (1, 3)}
    assert cache.fill_free(4) == [] and cache.num_free == 0
    for layer, expert, slot in first + rest:
        assert cache.slot_of(layer, expert) == slot
    # Nothing was evicted and no use was counted; a released cache fills nothing.
    assert (cache.num_evictions, cache.num_hits, cache.num_misses) == (evictions, hits, misses)
    assert cache.num_filled == 5 == cache.stats()["num_filled"]
    cache.mark_all_released()
    with pytest.raises(ExpertCacheReleasedError, match="before a fill"):
        cache.fill_free(1)


def test_a_fill_stays_inside_each_pool():
    cache = ExpertCache(num_layers=2, num_experts=4, num_slots=6,
                        pools=[([0], 4), ([1], 2)])
    cache.resize(2)  # the pools share the two slots by layers: one each
    cache.resize(6)
    filled = cache.fill_free(6)
    assert len(filled) == 6 and cache.num_free == 0
    for layer, _, slot in filled:
        pool_base = cache.bases[cache.pool_of(layer)]
        assert pool_base <= slot < pool_base + cache.max_sizes[cache.pool_of(layer)]
