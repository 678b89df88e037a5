"""ExpertPromotion on the CPU backend: a decode step's misses move into slots between steps,
the LRU expert is evicted, the slot table never announces a slot before its copy, and the
hit/miss counters count what the step read from where."""

import pytest
import torch

from strata.engine.core.memory.arena import ArenaReleasedError
from strata.engine.core.memory.expert_promotion import ExpertPromotion
from strata.engine.core.memory.expert_store import ExpertStore

E, INTER, HIDDEN, TOP_K = 8, 16, 12, 2


def _store(backend, num_slots=E, num_layers=2):
    g = torch.Generator().manual_seed(0)
    layers = {layer: (torch.randn(E, INTER, HIDDEN, generator=g),
                      torch.randn(E, INTER, HIDDEN, generator=g),
                      torch.randn(E, HIDDEN, INTER, generator=g)) for layer in range(num_layers)}
    store = ExpertStore(layers, num_slots=num_slots, backend=backend, num_experts_per_tok=TOP_K)
    # The promotion's mechanics with a miss admitted as soon as it outranks its victim:
    # the margin decode admits by (ADMIT_MARGIN_USES) is test_expert_policy.py's.
    store.cache.admit_margin_uses = 0.0
    return store


def _route(store, promotion, by_layer):
    """What a decode step does: the router writes its ids, then the decoder's after_step."""
    for layer, experts in by_layer.items():
        store.step_ids[layer, 0] = torch.tensor(experts)
    promotion.after_step()


def _assert_table_is_the_cache(store, in_flight=()):
    """Every published entry is a resident expert whose slot holds its weights; every resident
    expert is published unless its copy is in flight."""
    expected = torch.full_like(store.table, -1)
    for layer, expert, slot in store.cache.resident():
        if (layer, expert) not in in_flight:
            expected[layer, expert] = slot
    assert torch.equal(store.table, expected)
    for layer, expert in (expected >= 0).nonzero().tolist():
        slot = int(expected[layer, expert])
        for slots, host in zip(store.slot_weights, store.host_expert(layer, expert)):
            assert torch.equal(slots[slot], host)


def test_preload_publishes_the_table(backend):
    store = _store(backend)
    assert store.cache.num_resident == E
    _assert_table_is_the_cache(store)
    assert (store.table[1] == -1).all()  # layer 1 starts on the host
    store.close()


def test_misses_are_promoted_lru_evicted_and_published_after_their_copy(backend):
    store = _store(backend)
    promotion = ExpertPromotion(store)
    hits, misses = store.cache.num_hits, store.cache.num_misses
    _route(store, promotion, {0: [6, 7], 1: [3, 5]})
    promotion.collect()
    # The cache chose slots for layer 1's misses, evicting layer 0's oldest experts (0, 1),
    # whose entries are already -1; the new ones are not announced until their copies land.
    assert store.cache.slot_of(0, 0) is None and store.cache.slot_of(0, 1) is None
    assert store.cache.slot_of(1, 3) is not None and store.cache.slot_of(1, 5) is not None
    assert promotion.num_in_flight == 2
    _assert_table_is_the_cache(store, in_flight={(1, 3), (1, 5)})
    promotion.land()
    assert promotion.num_in_flight == 0
    _assert_table_is_the_cache(store)
    assert int(store.table[1, 3]) == store.cache.slot_of(1, 3)
    # Layer 0's 6 and 7 were read from slots, layer 1's 3 and 5 from the host copy.
    assert (store.cache.num_hits - hits, store.cache.num_misses - misses) == (2, 2)

    # The next step finds them resident: all hits, nothing to copy.
    _route(store, promotion, {0: [7, 2], 1: [5, 3]})
    promotion.before_step()
    assert (store.cache.num_hits - hits, store.cache.num_misses - misses) == (6, 2)
    assert promotion.num_in_flight == 0 and store.cache.num_evictions == 2
    store.close()


def test_a_promotion_evicted_before_it_lands_is_never_published(backend):
    store = _store(backend)
    promotion = ExpertPromotion(store)
    _route(store, promotion, {0: [0, 1], 1: [3, 5]})
    promotion.collect()
    slot_of_3 = store.cache.slot_of(1, 3)
    # A prefill needs all of layer 0 before the copies land: it takes layer 1's slots back.
    store.fetch_slots(0, list(range(E)))
    assert store.cache.slot_of(1, 3) is None
    promotion.land()
    assert int(store.table[1, 3]) == -1 and int(store.table[1, 5]) == -1
    assert (store.table[0] >= 0).all()
    assert int(store.table[0].eq(slot_of_3).sum()) == 1  # the slot now serves layer 0 only
    _assert_table_is_the_cache(store)
    store.close()


def test_the_hit_rate_counts_every_routed_expert(backend):
    store = _store(backend, num_slots=10, num_layers=3)
    promotion = ExpertPromotion(store)
    before = store.cache.num_hits + store.cache.num_misses
    g = torch.Generator().manual_seed(5)
    num_steps = 12
    for _ in range(num_steps):
        promotion.before_step()
        _route(store, promotion, {layer: torch.randperm(E, generator=g)[:TOP_K].tolist()
                                  for layer in range(3)})
    promotion.before_step()  # collects the last step
    assert store.cache.num_hits + store.cache.num_misses - before == num_steps * 3 * TOP_K
    assert store.cache.num_misses > 0 and store.cache.num_hits > 0
    _assert_table_is_the_cache(store)
    store.close()


def test_a_batch_step_counts_each_shared_expert_once_and_ignores_padding_rows(backend):
    """A batch step (fast/batch_graph.py) leaves row b's ids in step_ids[layer, b]; rows
    sharing an expert read it once, and padding rows after the real ones route too but
    must not move anything in."""
    store = _store(backend, num_slots=4, num_layers=1)  # experts 0..3 preloaded
    preloaded, preload_calls = store.status()["copied_bytes"], store.traffic.num_copy_calls
    promotion = ExpertPromotion(store)
    hits, misses = store.cache.num_hits, store.cache.num_misses
    store.step_ids[0, :4] = torch.tensor([[0, 4], [4, 1], [0, 1], [5, 6]])  # row 3: padding
    promotion.after_step(num_rows=3)
    promotion.before_step()
    promotion.land()
    assert (store.cache.num_hits - hits, store.cache.num_misses - misses) == (2, 1)
    assert store.cache.slot_of(0, 4) is not None
    assert store.cache.slot_of(0, 5) is None and store.cache.slot_of(0, 6) is None
    _assert_table_is_the_cache(store)
    # Rows wanting more experts than there are slots: the first four are candidates, and a
    # miss moves in only where it outranks the expert it would evict (7 over 3, used once
    # by the preload long ago; 0 and 1, used twice, stay); the rest stay on the host (the
    # step read them there), with no error.
    store.step_ids[0, :4] = torch.tensor([[7, 6], [5, 4], [3, 2], [1, 0]])
    promotion.after_step(num_rows=4)
    promotion.before_step()
    promotion.land()
    assert sorted(e for _, e, _ in store.cache.resident()) == [0, 1, 4, 7]
    assert store.cache.num_hits + store.cache.num_misses - hits - misses == 3 + 8
    _assert_table_is_the_cache(store)
    # /v1/status: 6 and 5 were read on the host and left there; the copies (4, then 7) timed.
    status = store.status()
    assert status["num_left_out"] == status["layers"][0]["num_left_out"] == 2
    promoted_bytes = 2 * store.bytes_per_expert
    assert status["timed_copy_bytes"] == status["copied_bytes"]  # the preload's, and these
    assert status["copied_bytes"] - preloaded == promoted_bytes
    assert status["num_copy_calls"] - preload_calls == 2 * 3  # a run of one: 3 projections
    assert status["copy_seconds"] > 0 and status["copy_gb_s"] > 0
    # Where the host copy's pages sit (memory/numa.py): a CPU store places nothing.
    assert status["host_numa"]["requested_node"] is None
    store.close()


def test_release_refill_and_bad_input(backend):
    store = _store(backend)
    promotion = ExpertPromotion(store)
    _route(store, promotion, {0: [0, 1], 1: [2, 3]})
    promotion.before_step()
    resident = store.cache.resident()
    store.release()
    assert (store.table == -1).all()
    with pytest.raises(ArenaReleasedError, match="'experts' is released"):
        promotion.before_step()
    store.refill()
    assert store.cache.resident() == resident
    _assert_table_is_the_cache(store)

    _route(store, promotion, {0: [0, E]})  # a router can never write this: a clear error
    with pytest.raises(ValueError, match=r"expert ids \[8\] are outside 0..7"):
        promotion.before_step()
    with pytest.raises(ValueError, match=r"num_experts_per_tok must be in 1..8"):
        ExpertStore({0: tuple(torch.zeros(E, 2, 2) for _ in range(3))}, E, backend,
                    num_experts_per_tok=0)
    with pytest.raises(ValueError, match="hit and miss counts"):
        store.cache.count(-1, 0)
    store.close()


def test_hits_misses_and_bytes_moved_are_counted_per_layer(backend):
    """What /v1/status's experts.layers reports: each layer's hits and misses, the bytes its
    misses read in place from the host copy, and the bytes copied into its slots."""
    store = _store(backend)  # layer 0's 8 experts preloaded, layer 1 on the host
    promotion = ExpertPromotion(store)
    per_expert = store.bytes_per_expert
    before = {row["layer"]: row for row in store.status()["layers"]}
    assert before[0]["copied_bytes"] == E * per_expert and before[1]["copied_bytes"] == 0
    _route(store, promotion, {0: [6, 7], 1: [3, 5]})
    promotion.before_step()
    promotion.land()
    _route(store, promotion, {0: [6, 2], 1: [3, 4]})
    promotion.before_step()
    promotion.land()
    status = store.status()
    rows = {row["layer"]: row for row in status["layers"]}

    def delta(layer, key):
        return rows[layer][key] - before[layer][key]

    # Layer 0: 6, 7, 6, 2 all resident (layer 1's first misses evicted 0 and 1). Layer 1: 3
    # and 5 missed, then 3 hit (promoted meanwhile) and 4 missed (evicting layer 0's 2).
    assert (delta(0, "num_hits"), delta(0, "num_misses")) == (4, 0)
    assert (delta(1, "num_hits"), delta(1, "num_misses")) == (1, 3)
    assert delta(0, "host_read_bytes") == 0 and delta(1, "host_read_bytes") == 3 * per_expert
    assert delta(0, "copied_bytes") == 0 and delta(1, "copied_bytes") == 3 * per_expert
    assert status["num_hits"] == sum(r["num_hits"] for r in rows.values())
    assert status["num_misses"] == sum(r["num_misses"] for r in rows.values())
    assert status["host_read_bytes"] == sum(r["host_read_bytes"] for r in rows.values())
    assert status["copied_bytes"] == sum(r["copied_bytes"] for r in rows.values())
    store.close()


def test_misses_computed_on_the_cpu_are_not_counted_as_host_reads_per_step(backend):
    """Each step's misses computed on the CPU (fast/moe_cpu_misses.py) are taken with that
    step's ids: a step collected while the next one runs counts its own, and work noted
    outside a step (a prefill's) belongs to none."""
    store = _store(backend)  # layer 0 resident, layer 1 on the host
    promotion = ExpertPromotion(store)
    per_expert = store.bytes_of(1)
    promotion.before_step()
    store.traffic.note_cpu_experts(1, 1)  # step 1 routes two misses in layer 1, one on the CPU
    _route(store, promotion, {0: [0, 1], 1: [2, 3]})
    store.traffic.note_cpu_experts(1, 2)  # step 2 is running: both its misses on the CPU
    promotion.collect()  # step 1 only: one of its misses was read in place
    assert store.traffic.host_read_bytes[1] == 1 * per_expert
    for layer, experts in {0: [0, 1], 1: [4, 5]}.items():
        store.step_ids[layer, 0] = torch.tensor(experts)
    promotion.after_step()
    promotion.collect()
    assert store.traffic.host_read_bytes[1] == 1 * per_expert  # none of step 2's
    assert store.traffic.num_cpu_experts[1] == 3
    store.traffic.note_cpu_experts(1, 1)  # a prefill's, before the next step
    promotion.before_step()
    _route(store, promotion, {0: [0, 1], 1: [6, 7]})
    promotion.collect()
    assert store.traffic.host_read_bytes[1] == 3 * per_expert  # both of this step's were read
    store.close()


def test_a_grown_cache_fills_chunk_by_chunk_and_publishes_only_what_landed(backend):
    store = _store(backend, num_slots=2 * E)
    promotion = ExpertPromotion(store)
    _route(store, promotion, {0: [0, 1], 1: [6, 7]})
    promotion.before_step()  # every expert resident: nothing free, nothing to fill
    assert not promotion.is_filling and promotion.fill() == 0
    store.resize(E)  # one layer's worth (the least a store keeps): layer 0's experts stay
    store.resize(2 * E)
    assert store.cache.num_free == E and promotion.is_filling
    _assert_table_is_the_cache(store)  # the new slots are empty and read as misses

    per_chunk = 3
    queued = promotion.fill(per_chunk * store.bytes_per_expert)
    assert queued == per_chunk and promotion.num_in_flight == per_chunk
    chosen = [(layer, expert) for layer, expert, _ in promotion._fill.assignments]
    # The most used first (6 and 7: the preload's use and the step's), then by expert;
    # queued in (layer, expert) order.
    assert chosen == [(1, 0), (1, 6), (1, 7)]
    _assert_table_is_the_cache(store, in_flight=set(chosen))  # not announced before landing
    promotion.land()
    _assert_table_is_the_cache(store)

    while promotion.is_filling:  # as the engine process does while idle
        promotion.fill_step()
    assert store.cache.num_free == 0 and store.cache.num_resident == 2 * E
    assert (store.table >= 0).all() and store.verify_slots() == 0
    _assert_table_is_the_cache(store)
    # A decode step afterwards hits everywhere and copies nothing.
    copied = store.traffic.status()["copied_bytes"]
    _route(store, promotion, {0: [2, 3], 1: [4, 5]})
    promotion.before_step()
    assert store.traffic.status()["copied_bytes"] == copied
    store.close()


def test_the_fill_counts_as_work_until_its_last_chunk_is_published(backend):
    store = _store(backend, num_slots=2 * E)
    promotion = ExpertPromotion(store)
    store.resize(E)
    store.resize(2 * E)
    assert promotion.fill(2 * E * store.bytes_per_expert) == E  # every free slot at once
    assert store.cache.num_free == 0
    # Copied (the CPU copies on return) but not published: still work for an idle step.
    assert promotion.fill() == 0 and promotion.is_filling
    assert (store.table[1] == -1).all()
    promotion.fill_step()
    assert not promotion.is_filling and (store.table >= 0).all()
    _assert_table_is_the_cache(store)
    store.close()
