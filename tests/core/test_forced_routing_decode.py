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
from strata.engine.core.models.forced_routing import ForcedRouting
from tests.helpers.moe_cache_cpu import CONFIG, GREEDY, NUM_LAYERS, PROMPT, TOP_K, E, build_on_cpu
from tests.helpers.routing_trace import StepRecorder, random_trace

NUM_NEW = 4


def _trace(num_tokens: int, seed: int) -> np.ndarray:
    return random_trace(num_tokens, NUM_LAYERS, E, TOP_K, seed)


def _decode(moe_impl: str) -> tuple[list[int], list[list[int]], int, int]:
    """(tokens, each step's routed ids, hits, misses) of a forced decode over 8 of 24 slots."""
    memory, model = build_on_cpu(CONFIG, str(E))
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
        recorder = StepRecorder(store, forced.inner)  # the ids each step's routers left
        forced.inner = recorder
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
        return tokens, recorder.routed, hits, misses
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
