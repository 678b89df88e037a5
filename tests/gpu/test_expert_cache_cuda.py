"""A partial expert cache on CUDA: graph-replayed decode reads missing experts in place from
the mapped host copy, gives the all-resident model's tokens bit for bit, and the hit rate
rises as promotions land between steps."""

from __future__ import annotations

import pytest
import torch

from strata.engine.core.fast import GraphDecoder
from strata.engine.core.kv_cache import KVCache
from tests.gpu.gpu_helpers import build_with_expert_cache
from tests.helpers.moe_cache_cuda import CONFIG, GREEDY, NUM_LAYERS, PROMPT, TOP_K, settle

pytestmark = pytest.mark.gpu

# 4 steps route to at most 4 * 3 * 2 = 24 experts: as many as the cache's slots, so a second
# pass over the same steps finds every one of them promoted.
NUM_DECODE, NUM_SLOTS = 4, 24


def _build(expert_cache: str):
    return build_with_expert_cache(CONFIG, expert_cache)


def _counters(store) -> tuple[int, int]:
    return store.cache.num_hits, store.cache.num_misses


def test_graph_decode_over_a_partial_cache_equals_all_resident() -> None:
    memory, model = _build("all")
    try:
        kv = KVCache.for_config(CONFIG, 256, torch.bfloat16, "cuda")
        decoder = GraphDecoder(model, min_bucket_tokens=64)
        expected = list(decoder.generate(kv, PROMPT, GREEDY, NUM_DECODE + 1))
    finally:
        memory.close()

    memory, model = _build(str(NUM_SLOTS))
    try:
        store, promotion = memory.experts, memory.promotion
        assert memory.expert_mode == "slots" and store.host.is_pinned
        assert store.host.device_address is not None, store.host.pin_note
        decoder = GraphDecoder(model, min_bucket_tokens=64, step_hook=promotion)
        assert decoder.use_cuda_graphs and decoder.moe_impl == "triton", decoder.note
        kv = KVCache.for_config(CONFIG, 256, torch.bfloat16, "cuda")
        # The prefill's loop leaves layers 2 and 1 resident: layer 0's experts start on the host.
        logits = decoder.prefill(kv, torch.tensor(PROMPT, device="cuda"), 0)
        first = decoder.sample_first(logits, GREEDY)
        assert first == expected[0]

        def decode_pass() -> tuple[list[int], float]:
            before = _counters(store)
            tokens = list(decoder.decode(kv, first, len(PROMPT), NUM_DECODE, GREEDY,
                                         continue_request=True))
            settle(promotion)
            hits, misses = (a - b for a, b in zip(_counters(store), before))
            assert hits + misses == NUM_DECODE * NUM_LAYERS * TOP_K
            return tokens, hits / (hits + misses)

        tokens, cold_hit_rate = decode_pass()
        assert tokens == expected[1:]  # bit for bit, misses read from the mapped host copy
        assert cold_hit_rate < 1.0
        # The same steps again (same position, same K/V): promoted experts now hit. Not all:
        # a miss takes a slot only if used more than its victim (expert_cache.py's admission).
        tokens, warm_hit_rate = decode_pass()
        assert tokens == expected[1:]
        assert warm_hit_rate > cold_hit_rate
        assert store.verify_slots() == 0
        published = (store.table >= 0).nonzero().tolist()
        assert published and all(
            store.local_slot(layer, store.cache.slot_of(layer, expert))
            == int(store.table[layer, expert])
            for layer, expert in published)
    finally:
        memory.close()
