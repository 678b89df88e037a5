"""A batch step over quantized experts (quant/expert_batch.py) in an engine, through Triton's
CPU interpreter: a tiny Qwen3-MoE GGUF with a different expert type per projection and layer,
whose batched greedy decode of three sequences (bucket 4: one padding row) gives each
sequence the tokens it gets alone, with every MoE layer of the step through the batched
kernels; and the same through a partial expert cache's slot table (12 slots of 16 experts,
misses read from the host copy, promoted between steps). 32-value block types keep the
model at hidden 64 (the interpreter pays per op); test_quant_expert_batch.py runs the
K-quants through the kernels alone. The GPU twin is tests/gpu/test_quant_expert_batch_cuda.py.
"""

from __future__ import annotations

import os

import pytest
import torch

# Must precede the first Triton import: triton.jit picks the interpreter at decoration time.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="Triton CPU interpreter not enabled"
)

from strata.engine.core.fast.batch_graph import BatchDecoder
from strata.engine.core.fast.pointwise import EAGER_OPS
from strata.engine.core.quant.experts import QuantizedExperts
from strata.engine.protocol import SamplingSpec
from tests.core.batch_helpers import alone, assert_same_or_near_tie, run_batch
from tests.core.test_quant_experts import _engine, _gguf
from tests.helpers.quant_blocks import alternating_mix

NUM_NEW = 3  # each interpreted step costs CI seconds
# Gate and up of different types in one kernel; every type one the planes kernels read; 4
# layers in two slot classes, so a partial cache leaves some experts of each on the host.
NARROW_MIX = alternating_mix(("Q8_0", "Q4_0", "Q5_1"), ("Q4_1", "Q5_0", "Q8_0"))
CHATS = [[(13 * i + 7 * j) % 300 + 5 for j in range(3 + 2 * i)] for i in range(3)]


def _count_batched(monkeypatch) -> list[int]:
    """The row counts of the MoE blocks that took the batched quantized kernels, which
    these tiny batches take only with the row threshold lowered (moe_batch)."""
    from strata.engine.core.fast import batch_experts
    from strata.engine.core.quant import expert_batch

    monkeypatch.setattr(batch_experts, "QUANT_BATCHED_MIN_ROWS", 2)

    calls: list[tuple[int, bool]] = []  # (rows, through a slot table)
    batched = expert_batch.routed_rows

    def counted(x, gate, up, down, ids, weights, table=None, *args):
        calls.append((x.shape[0], table is not None))
        return batched(x, gate, up, down, ids, weights, table, *args)

    monkeypatch.setattr(expert_batch, "routed_rows", counted)
    return calls


def _batch_equals_alone(engine, calls: list, step_hook=None) -> None:
    step = BatchDecoder(engine.model, EAGER_OPS, "triton", use_cuda_graphs=False,
                        fused_attention=False, min_bucket_tokens=16, step_hook=step_hook)
    engine._runner.batch = step
    spec = SamplingSpec(max_tokens=NUM_NEW, temperature=0.0)
    expected = [alone(engine, p, spec, i) for i, p in enumerate(CHATS)]
    calls.clear()  # alone, a sequence decodes one row at a time
    got = run_batch(engine, {f"r{i}": (p, spec, i) for i, p in enumerate(CHATS)})
    for i, prompt in enumerate(CHATS):
        assert_same_or_near_tie(engine, prompt, expected[i], got.tokens[f"r{i}"])
    assert 4 in step._buffers


def test_a_batch_over_resident_quantized_experts_decodes_like_each_sequence_alone(
        tmp_path, monkeypatch) -> None:
    path = _gguf(tmp_path, "qwen3_moe", "Q8_0", NARROW_MIX)
    engine = _engine(path, monkeypatch, quantized=True)
    calls = _count_batched(monkeypatch)
    try:
        assert isinstance(engine.model.model.layers[0].mlp.experts.gate_proj, QuantizedExperts)
        _batch_equals_alone(engine, calls)
        # Every MoE layer of every batched step (3 rows padded to 4) took the kernels.
        num_layers = len(engine.model.model.layers)
        assert calls and set(calls) <= {(4, False), (2, False)}
        assert len(calls) % num_layers == 0
    finally:
        engine.close()


def test_a_batch_through_a_partial_expert_cache_decodes_like_each_sequence_alone(
        tmp_path, monkeypatch) -> None:
    """The batch step reads through the slot table (a graph can hold it: is_capturable) and
    the promotion runs around it, counting what the batch's real rows read."""
    from strata.engine.core.fast.batch_graph import MAX_BATCH_ROWS, is_capturable
    from strata.engine.core.memory.expert_store import MAX_STEP_ROWS
    from strata.engine.core.quant.expert_batch import MAX_ROWS

    assert MAX_STEP_ROWS == MAX_ROWS == MAX_BATCH_ROWS  # every row of a bucket has its ids

    path = _gguf(tmp_path, "qwen3_moe", "Q8_0", NARROW_MIX)
    engine = _engine(path, monkeypatch, quantized=True, expert_cache="24")  # of 32
    calls = _count_batched(monkeypatch)
    try:
        assert engine.memory.expert_mode == "slots"
        assert is_capturable(engine.model, "triton") and not is_capturable(engine.model, "loop")
        cache = engine.memory.experts.cache
        counted: list[tuple[int, int]] = []  # (hits, misses) of each step the promotion saw
        count = cache.count
        monkeypatch.setattr(cache, "count", lambda h, m, layer=None: (
            counted.append((h, m, layer)), count(h, m, layer)))
        _batch_equals_alone(engine, calls, step_hook=engine.memory.promotion)
        assert calls and set(calls) <= {(4, True), (2, True)}
        # The promotion saw the batch steps' reads (the loop of a sequence alone counts its
        # own), and some of them missed: read in place from the host copy.
        engine.memory.promotion.before_step()  # collects the last step
        # One count per MoE layer a step (the per-layer counters of /v1/status).
        num_steps = len(calls) // len(engine.model.model.layers)
        assert len(counted) == num_steps * len({layer for *_, layer in counted})
        assert sum(m for _, m, _ in counted) > 0
    finally:
        engine.close()
