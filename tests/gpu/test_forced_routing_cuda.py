"""Forced routing (a benchmark's hook) under CUDA graph replay over a partial expert cache:
each replayed step routes the trace row written before it, the promotion sees those ids, and
the graph-replayed tokens equal the same steps called eagerly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from strata.engine.core.fast import GraphDecoder
from strata.engine.core.kv_cache import KVCache
from strata.engine.core.model_config import ModelConfig
from strata.engine.core.models.forced_routing import ForcedRouting
from strata.engine.protocol import SamplingSpec
from tests.gpu.gpu_helpers import build_with_expert_cache

pytestmark = pytest.mark.gpu

E, TOP_K, NUM_LAYERS = 16, 2, 3
CONFIG = ModelConfig(model_type="qwen3_moe", vocab_size=512, hidden_size=256,
                     intermediate_size=384, num_hidden_layers=NUM_LAYERS, num_attention_heads=8,
                     num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
                     num_experts=E, num_experts_per_tok=TOP_K, moe_intermediate_size=128)
GREEDY = SamplingSpec(max_tokens=64, temperature=0.0)
PROMPT = [(11 * i + 5) % 512 for i in range(40)]
NUM_DECODE, NUM_SLOTS = 12, 24


def _trace() -> torch.Tensor:
    rng = np.random.default_rng(0)
    rows = [[rng.permutation(E)[:TOP_K] for _ in range(NUM_LAYERS)] for _ in range(7)]
    return torch.tensor(np.array(rows), dtype=torch.int32)  # [7 steps, layers, k], cycles


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
        routed: list[list[int]] = []

        class Recorder:  # after each step, the ids its routers left for the cache
            def before_step(self) -> None:
                promotion.before_step()

            def after_step(self, num_rows: int = 1) -> None:
                routed.append(store.step_ids[:, 0].flatten().tolist())  # a test may sync
                promotion.after_step(num_rows)

        forced.inner = Recorder()
        kv = KVCache.for_config(CONFIG, 256, torch.bfloat16, "cuda")
        logits = decoder.prefill(kv, torch.tensor(PROMPT, device="cuda"), 0)
        first = decoder.sample_first(logits, GREEDY)
        hits, misses = store.cache.num_hits, store.cache.num_misses
        tokens = list(decoder.decode(kv, first, len(PROMPT), NUM_DECODE, GREEDY))
        for _ in range(2):
            torch.cuda.synchronize()
            promotion.before_step()
        hits, misses = store.cache.num_hits - hits, store.cache.num_misses - misses
        assert forced.position == len(routed)
        forced.detach()
        assert decoder.step_hook is promotion
        return [first, *tokens], routed, hits / (hits + misses)
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
