"""Prefill over a partial expert cache on CUDA (memory/expert_staging.py): the staging's
copies run on the side stream, the next layer's behind this one's GEMMs, and the logits
equal the all-resident model's, before and after the cache shrinks; the cache is untouched
and each layer's missing experts are copied from the host once per chunk."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from strata.engine.core.fast import moe_staged
from strata.engine.core.fast.pointwise import EAGER_OPS
from strata.engine.core.fast.prefill import prefill
from strata.engine.core.kv_cache import KVCache
from tests.gpu.gpu_helpers import build_with_expert_cache
from tests.helpers import moe_cache_cuda
from tests.helpers.moe_cache_cuda import TOP_K, E

pytestmark = pytest.mark.gpu

NUM_LAYERS = 4  # the decode tests' MoE with a fourth layer
CONFIG = dataclasses.replace(moe_cache_cuda.CONFIG, num_hidden_layers=NUM_LAYERS)
PROMPT = [(11 * i + 5) % 512 for i in range(300)]
CHUNK = 128  # 256 routed rows: 16 an expert, so every expert is staged and the next prefetched


def _prefill(model) -> torch.Tensor:
    kv = KVCache.for_config(CONFIG, 512, torch.bfloat16, device=torch.device("cuda"))
    with torch.inference_mode():
        logits = prefill(model, kv, torch.tensor(PROMPT, device="cuda"), 0, CHUNK, "triton",
                         EAGER_OPS)
    torch.cuda.synchronize()
    return logits.float().cpu()


def test_staged_prefill_equals_all_resident_on_cuda() -> None:
    assert CHUNK * TOP_K >= moe_staged.STAGE_ALL_ROWS_PER_EXPERT * E
    memory, model = build_with_expert_cache(CONFIG, "all")
    try:
        expected = _prefill(model)
    finally:
        memory.close()
    memory, model = build_with_expert_cache(CONFIG, "40")  # of 64
    try:
        store = memory.experts
        assert memory.expert_mode == "slots" and store.staging is not None
        for num_slots in (40, E):  # E: one layer's worth, most experts on the host
            store.resize(num_slots)
            resident = store.cache.resident()
            staged = list(store.staging.staged_experts)
            torch.testing.assert_close(_prefill(model), expected, rtol=2e-2, atol=2e-2)
            assert store.cache.resident() == resident  # no eviction, no admission
            num_chunks = -(-len(PROMPT) // CHUNK)  # 128, 128, 44
            for layer in range(NUM_LAYERS - 1):
                missing = E - sum(1 for lay, _, _ in resident if lay == layer)
                copied = store.staging.staged_experts[layer] - staged[layer]
                assert 2 * missing <= copied <= num_chunks * missing, (layer, copied)
    finally:
        memory.close()
