"""Forced routing through the decoder over a partial expert cache (CPU, Triton interpreter: the
kernels, step and hook of the CUDA-graph path): every step routes its trace row, the
promotion counts those ids, prefill chunks take the prefill trace, and the reference loop
fed the same rows decodes the same tokens."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():  # before the first Triton import (see test_fast_paths.py)
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="Triton CPU interpreter not enabled"
)

from strata.engine.core.fast import GraphDecoder
from strata.engine.core.kv_cache import KVCache
from strata.engine.core.memory.backend import backend_for
from strata.engine.core.model_config import ModelConfig
from strata.engine.core.models.forced_routing import ForcedRouting
from strata.engine.core.residency import ModelMemory
from strata.engine.core.weight_source import RandomWeights
from strata.engine.protocol import SamplingSpec

E, TOP_K, NUM_LAYERS = 8, 2, 3
CONFIG = ModelConfig(model_type="qwen3_moe", vocab_size=96, hidden_size=64, intermediate_size=80,
                     num_hidden_layers=NUM_LAYERS, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=16, max_position_embeddings=256, num_experts=E,
                     num_experts_per_tok=TOP_K, moe_intermediate_size=24)
GREEDY = SamplingSpec(max_tokens=64, temperature=0.0)
PROMPT = [(7 * i + 3) % 96 for i in range(13)]
NUM_NEW = 4


def _trace(num_tokens: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.array([[rng.permutation(E)[:TOP_K] for _ in range(NUM_LAYERS)]
                     for _ in range(num_tokens)], dtype=np.int32)


def _decode(moe_impl: str) -> tuple[list[int], list[list[int]], int, int]:
    """(tokens, each step's routed ids, hits, misses) of a forced decode over 8 of 24 slots."""
    memory = ModelMemory(backend_for("cpu"), torch.float32)
    model = memory.build(CONFIG, RandomWeights(torch.device("cpu"), std=0.15), str(E))
    try:
        store, promotion = memory.experts, memory.promotion
        decoder = GraphDecoder(model, moe_impl=moe_impl, min_bucket_tokens=16,
                               step_hook=promotion)
        assert decoder.moe_impl == moe_impl
        forced = ForcedRouting(_trace(NUM_NEW, 1), E, torch.device("cpu"))
        forced.set_prefill(_trace(len(PROMPT), 2))
        forced.attach(model, decoder)
        assert decoder.step_hook is forced
        assert forced.inner is (promotion if moe_impl != "loop" else None)
        routed: list[list[int]] = []

        class Recorder:  # the ids each step's routers left for the cache
            def before_step(self) -> None:
                if moe_impl != "loop":
                    promotion.before_step()

            def after_step(self, num_rows: int = 1) -> None:
                routed.append(store.step_ids[:, 0].flatten().tolist())
                if moe_impl != "loop":
                    promotion.after_step(num_rows)

        forced.inner = Recorder()
        kv = KVCache.for_config(CONFIG, 64)
        logits = decoder.prefill(kv, torch.tensor(PROMPT), 0)
        # Every layer took a row per prompt token, but the last: a prefill computes its MLP
        # for the last token alone, which reads the step's row as one token does.
        assert forced._prefill_pos == [len(PROMPT)] * (NUM_LAYERS - 1) + [0]
        tokens = [decoder.sample_first(logits, GREEDY)]
        hits, misses = store.cache.num_hits, store.cache.num_misses
        tokens += decoder.decode(kv, tokens[0], len(PROMPT), NUM_NEW - 1, GREEDY,
                                 continue_request=True)
        promotion.before_step()
        hits, misses = store.cache.num_hits - hits, store.cache.num_misses - misses
        forced.detach()
        assert decoder.step_hook is (promotion if moe_impl != "loop" else None)
        assert all(layer.mlp.forced is None for layer in model.model.layers)
        return tokens, routed, hits, misses
    finally:
        memory.close()


def test_each_decode_step_routes_its_trace_row_like_the_reference_loop() -> None:
    tokens, routed, hits, misses = _decode("triton")
    trace = _trace(NUM_NEW, 1)
    assert len(routed) == NUM_NEW - 1
    for step, ids in enumerate(routed):
        assert ids == trace[step].flatten().tolist(), step
    # The promotion counted the forced ids: 8 slots cannot hold what the trace routes.
    assert hits + misses == len(routed) * NUM_LAYERS * TOP_K and misses > 0
    loop_tokens, _, _, _ = _decode("loop")  # SparseMoE.forward reads the same rows
    assert loop_tokens == tokens
