"""Prefill over a partial expert cache stages each layer's experts whole (memory/
expert_staging.py, fast/moe_staged.py): the logits equal the all-resident model's, each
expert that is not resident is copied from the host copy at most once per chunk and layer,
and the cache's residency (decode's working set) is left as it was."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():  # before the first Triton import (see test_fast_paths.py)
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="Triton CPU interpreter not enabled"
)

from strata.engine.core.fast import moe_staged
from strata.engine.core.fast.pointwise import EAGER_OPS
from strata.engine.core.fast.prefill import prefill
from strata.engine.core.kv_cache import KVCache
from strata.engine.core.memory import expert_staging
from strata.engine.core.residency import ModelMemory
from tests.helpers import moe_cache_cpu
from tests.helpers.moe_cache_cpu import TOP_K, E, build_on_cpu

# The decode tests' tiny MoE with a fourth layer, and room for the long prompt.
NUM_LAYERS = 4
CONFIG = dataclasses.replace(moe_cache_cpu.CONFIG, num_hidden_layers=NUM_LAYERS,
                             max_position_embeddings=512)
PROMPT = [(7 * i + 3) % 96 for i in range(150)]


def _prefill(model, chunk_tokens: int) -> torch.Tensor:
    kv = KVCache.for_config(CONFIG, 256)
    with torch.inference_mode():
        return prefill(model, kv, torch.tensor(PROMPT), 0, chunk_tokens, "triton", EAGER_OPS)


@pytest.fixture(scope="module")
def resident_logits() -> dict[int, torch.Tensor]:
    memory, model = build_on_cpu(CONFIG, "all")
    try:
        assert memory.expert_mode == "all" and memory.experts.staging is None
        return {chunk: _prefill(model, chunk) for chunk in (64, 8)}
    finally:
        memory.close()


@pytest.mark.parametrize("chunk_tokens", [64, 8])  # every expert staged unasked; routed only
def test_staged_prefill_equals_all_resident_and_copies_each_missing_expert_once(
        resident_logits, chunk_tokens: int, monkeypatch) -> None:
    monkeypatch.setattr(expert_staging, "MAX_GAP_BYTES", 0)  # host copies: missing only
    # 64 tokens x 2 of 8 experts: 16 rows an expert, the staged-all threshold; 8: below it.
    assert (chunk_tokens * TOP_K >= moe_staged.STAGE_ALL_ROWS_PER_EXPERT * E) == (
        chunk_tokens == 64)
    memory, model = build_on_cpu(CONFIG, "12")  # 12 slots for 32 experts
    try:
        store = memory.experts
        assert memory.expert_mode == "slots" and store.staging is not None
        resident = store.cache.resident()
        table = store.table.clone()
        evictions, misses = store.cache.num_evictions, store.cache.num_misses

        copied: list[tuple[int, tuple[int, ...]]] = []  # (layer, experts) per host copy
        stage = store.staging.stage

        def counting_stage(layer, experts=None, wait=True):
            before = store.staging.staged_experts[layer]
            out = stage(layer, experts, wait)
            copied.append((layer, store.staging.staged_experts[layer] - before))
            return out

        monkeypatch.setattr(store.staging, "stage", counting_stage)
        logits = _prefill(model, chunk_tokens)
        torch.testing.assert_close(logits, resident_logits[chunk_tokens], rtol=0, atol=1e-5)

        # The cache is untouched: no lookup, no eviction, the same slots and table.
        assert store.cache.resident() == resident
        assert torch.equal(store.table, table)
        assert (store.cache.num_evictions, store.cache.num_misses) == (evictions, misses)

        # Per layer, what was copied from the host is at most its experts not in slots,
        # per chunk.
        resident_of = {layer: {e for lay, e, _ in resident if lay == layer}
                       for layer in range(NUM_LAYERS)}
        sizes = [min(chunk_tokens, len(PROMPT) - b) for b in range(0, len(PROMPT), chunk_tokens)]
        staged_all = sum(n * TOP_K >= moe_staged.STAGE_ALL_ROWS_PER_EXPERT * E for n in sizes)
        assert staged_all == (2 if chunk_tokens == 64 else 0)  # 64, 64, 22; or 19 x 8
        for layer in range(NUM_LAYERS):
            missing = E - len(resident_of[layer])
            total = store.staging.staged_experts[layer]
            # The last layer runs its MLP only in the last chunk (fast/prefill.py).
            chunks = len(sizes) if layer < NUM_LAYERS - 1 else 1
            assert total <= chunks * missing, (layer, total)
            assert store.staging.staged_bytes[layer] == total * store.bytes_of(layer)
            if layer < NUM_LAYERS - 1:  # a chunk that stages all copies exactly the missing
                assert total >= staged_all * missing, (layer, total)
        assert sum(n for _, n in copied) == sum(store.staging.staged_experts)
        status = store.status()
        assert status["staging_bytes"] == store.staging.nbytes > 0
        assert status["staged_bytes"] == sum(store.staging.staged_bytes) > 0
        # The resident experts came from their slots (expert_staging.wide_rows' gather).
        assert status["gathered_bytes"] == sum(store.staging.gathered_bytes) > 0
        assert status["num_staged_copy_calls"] == store.staging.num_copy_calls > 0
    finally:
        memory.close()


def test_copy_runs_bridge_small_gaps_of_resident_experts_only() -> None:
    runs = expert_staging.copy_runs([0, 1, 3, 7, 9], resident={2, 4, 5, 6, 8},
                                    bytes_per_expert=10, max_gap_bytes=10)
    assert runs == [(0, 4), (7, 3)]  # 2 and 8 ride along; 4..6 (30 bytes) do not
    # A gap holding an expert that is neither missing nor resident (stale) is not bridged.
    assert expert_staging.copy_runs([0, 2], resident=set(), bytes_per_expert=1,
                                    max_gap_bytes=10) == [(0, 1), (2, 1)]


def test_staging_is_mapped_and_counted_with_the_slots() -> None:
    memory, _ = build_on_cpu(CONFIG, "12")
    try:
        store = memory.experts
        per_layer = E * store.bytes_of(0)
        assert per_layer <= store.staging.nbytes < per_layer + 3 * expert_staging.ALIGN_BYTES
        # Shrinking keeps the staging mapped: what a budget must leave room for.
        store.resize(E)
        assert store.mapped_bytes_at(E) >= E * store.bytes_of(0) + store.staging.nbytes
        store.arena.check_mapped(store.staging.flat.data_ptr() - store.arena.base_address,
                                 store.staging.nbytes)
    finally:
        memory.close()


def test_auto_sizing_leaves_room_for_the_staging_of_a_partial_cache(monkeypatch) -> None:
    from strata.engine.core import residency
    from strata.units import MIB

    memory = ModelMemory.__new__(ModelMemory)
    memory.device, memory.dtype = torch.device("cuda", 0), torch.bfloat16  # no GPU touched
    memory.backend = None
    per_expert, staging = 1 * MIB, 8 * MIB
    free = residency.EXPERT_RESERVE_BYTES + 20 * MIB
    monkeypatch.setattr(residency, "read_free_vram_bytes", lambda index: free)
    # 20 MiB holds 20 of 32 experts; the staging's 8 MiB leaves 12.
    assert memory._expert_slots("auto", CONFIG, NUM_LAYERS, per_expert, 1, staging) == 12
    assert memory._expert_slots("auto", CONFIG, NUM_LAYERS, per_expert, 1, 0) == 20
    # All resident: no staging to leave room for.
    monkeypatch.setattr(residency, "read_free_vram_bytes", lambda index: free + 12 * MIB)
    assert memory._expert_slots("auto", CONFIG, NUM_LAYERS, per_expert, 1, staging) == 32
