"""Forced routing (a benchmark's hook) under CUDA graph replay over a partial expert cache:
each replayed step routes the trace row written before it, the promotion sees those ids, and
the graph-replayed tokens equal the same steps called eagerly."""

from __future__ import annotations

import pytest
import torch

from strata.engine.core.fast import GraphDecoder
from strata.engine.core.kv_cache import KVCache
from strata.engine.core.models.forced_routing import ForcedRouting
from tests.gpu.gpu_helpers import build_with_expert_cache
from tests.helpers.moe_cache_cuda import CONFIG, GREEDY, NUM_LAYERS, PROMPT, TOP_K, E, settle
from tests.helpers.routing_trace import StepRecorder, random_trace

pytestmark = pytest.mark.gpu

NUM_DECODE, NUM_SLOTS = 12, 24


def _trace() -> torch.Tensor:
    """[7 steps, layers, k]: the decode cycles through it."""
    return torch.from_numpy(random_trace(7, NUM_LAYERS, E, TOP_K, seed=0))


def _decode(use_cuda_graphs: bool) -> tuple[list[int], list[list[int]], float]:
    """(tokens, each step's routed ids of every layer, hit rate) with the trace forced."""
    memory, model = build_with_expert_cache(CONFIG, str(NUM_SLOTS))
    try:
        store, promotion = memory.experts, memory.promotion
        decoder = GraphDecoder(model, min_bucket_tokens=64, step_hook=promotion,
                               use_cuda_graphs=use_cuda_graphs)
        assert decoder.moe_impl == "triton", decoder.note
        forced = ForcedRouting(_trace(), E, torch.device("cuda"))
        forced.attach(model, decoder)
        recorder = StepRecorder(store, promotion)  # after each step, the ids its routers left
        forced.inner = recorder
        kv = KVCache.for_config(CONFIG, 256, torch.bfloat16, "cuda")
        logits = decoder.prefill(kv, torch.tensor(PROMPT, device="cuda"), 0)
        first = decoder.sample_first(logits, GREEDY)
        hits, misses = store.cache.num_hits, store.cache.num_misses
        tokens = list(decoder.decode(kv, first, len(PROMPT), NUM_DECODE, GREEDY))
        settle(promotion)
        hits, misses = store.cache.num_hits - hits, store.cache.num_misses - misses
        assert forced.position == len(recorder.routed)
        forced.detach()
        assert decoder.step_hook is promotion
        return [first, *tokens], recorder.routed, hits / (hits + misses)
    finally:
        memory.close()


def test_graph_replays_route_each_steps_trace_row_and_match_eager_steps() -> None:
    tokens, routed, hit_rate = _decode(use_cuda_graphs=True)
    trace = _trace()
    assert len(routed) >= NUM_DECODE - 1
    for step, ids in enumerate(routed):
        assert ids == trace[step % 7].long().flatten().tolist(), step
    assert hit_rate < 1.0  # the trace's experts do not all fit 24 slots
    eager_tokens, eager_routed, _ = _decode(use_cuda_graphs=False)
    assert eager_routed == routed
    assert eager_tokens == tokens
