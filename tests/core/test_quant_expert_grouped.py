"""The dequantize-then-grouped-GEMM MoE prefill (quant/expert_grouped.py) and the choice
between it and expert_gemm.py (fast/moe_prefill.py), through Triton's CPU interpreter in
float32: experts in groups of a lowered scratch (rows brought to the front and back on the
device), one group, empty experts, against torch in float64; then the per-call choice by
routed rows, both branches, equal. tests/gpu/test_quant_dequant_cuda.py repeats them in bf16
at Qwen3-30B-A3B's shape, with a CUDA graph.
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

from gguf import GGMLQuantizationType as QT

from tests.core.test_quant_expert_gemm import (
    BLOCK32_SHAPE,
    COUNTS,
    K_QUANT_SHAPE,
    _assert_close,
    _layer,
    _reference,
    _rows,
)
from tests.helpers.moe_stub import moe_stub


def _shuffled(rows: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, source) with x[source] == rows: tokens in another order than the sorted rows."""
    perm = torch.randperm(rows.shape[0], generator=torch.Generator().manual_seed(seed))
    x = torch.empty_like(rows)
    x[perm] = rows
    return x, perm


@pytest.mark.parametrize("group", [2, len(COUNTS)], ids=lambda g: f"group{g}")
def test_groups_of_experts_match_torch(group: int, monkeypatch) -> None:
    """Groups of 2 of 7 experts (the last one short; rows moved to the front and back
    by the device's offsets; some groups without rows) and every expert at once."""
    from strata.engine.core.quant import expert_grouped

    hidden, inter = BLOCK32_SHAPE
    blocks, dense = _layer((QT.Q8_0, QT.Q4_0, QT.Q8_0), hidden, inter)
    per_expert = 2 * inter * hidden * 4  # float32 gate + up
    monkeypatch.setattr(expert_grouped, "EXPERT_SCRATCH_BYTES", group * per_expert)
    assert expert_grouped.experts_per_group(*blocks) == group
    rows, offsets, weights = _rows(hidden, seed=group)
    _, y_expected = _reference(rows, offsets, weights, dense)
    x, source = _shuffled(rows, seed=group)
    y = expert_grouped.experts_mlp(x, source, offsets, weights, *blocks)
    assert y.shape == rows.shape
    _assert_close(y, y_expected)


def test_k_quant_experts_in_groups_match_torch(monkeypatch) -> None:
    """Q4_K_M's types (gate and up Q4_K, down Q6_K), groups of 4 of 7."""
    from strata.engine.core.quant import expert_grouped

    hidden, inter = K_QUANT_SHAPE
    blocks, dense = _layer((QT.Q4_K, QT.Q4_K, QT.Q6_K), hidden, inter)
    monkeypatch.setattr(expert_grouped, "EXPERT_SCRATCH_BYTES", 4 * 2 * inter * hidden * 4)
    rows, offsets, weights = _rows(hidden, seed=9)
    _, y_expected = _reference(rows, offsets, weights, dense)
    x, source = _shuffled(rows, seed=9)
    _assert_close(expert_grouped.experts_mlp(x, source, offsets, weights, *blocks), y_expected)
    assert expert_grouped.experts_mlp(x[:0], source[:0], offsets * 0, weights[:0],
                                      *blocks).shape == (0, hidden)


def test_the_routed_row_count_picks_the_path(monkeypatch, counted_paths) -> None:
    """experts_sorted takes expert_gemm below min_rows routed rows, the grouped path from
    there on; lowering DEQUANT_MIN_ROWS_PER_EXPERT moves the same call across, with the same
    result (within float32 summation order)."""
    from strata.engine.core.fast import moe_prefill
    from strata.engine.core.quant import expert_grouped

    hidden, inter = BLOCK32_SHAPE
    blocks, dense = _layer((QT.Q8_0,) * 3, hidden, inter)
    monkeypatch.setattr(expert_grouped, "EXPERT_SCRATCH_BYTES", 3 * 2 * inter * hidden * 4)
    num_experts, top_k, tokens = len(COUNTS), 2, 20
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(tokens, hidden, generator=gen) * 0.02
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k]
                       for _ in range(tokens)])  # [T, k]
    weights = torch.rand(tokens, top_k, generator=gen) + 0.1
    moe = moe_stub(*blocks)
    rows = tokens * top_k  # 40: 5.7 per expert
    monkeypatch.setattr(expert_grouped, "DEQUANT_MIN_ROWS_PER_EXPERT", 8)
    assert rows < expert_grouped.min_rows(num_experts)
    by_gemm = moe_prefill.experts_sorted(moe, x, weights, ids)
    assert counted_paths == {"gemm": 1, "grouped": 0}
    monkeypatch.setattr(expert_grouped, "DEQUANT_MIN_ROWS_PER_EXPERT", 5)
    by_grouped = moe_prefill.experts_sorted(moe, x, weights, ids)
    assert counted_paths == {"gemm": 1, "grouped": 1}
    expected = torch.zeros(tokens, hidden, dtype=torch.float64)
    gate, up, down = (d.double() for d in dense)
    for t in range(tokens):
        for j in range(top_k):
            e, row = int(ids[t, j]), x[t].double()
            act = torch.nn.functional.silu(gate[e] @ row) * (up[e] @ row) * weights[t, j]
            expected[t] += down[e] @ act
    _assert_close(by_gemm, expected)
    _assert_close(by_grouped, expected)


@pytest.mark.parametrize("group", [2, len(COUNTS)], ids=lambda g: f"group{g}")
def test_padded_rows_into_a_given_output_are_neither_read_nor_written(group: int,
                                                                      monkeypatch) -> None:
    """What a replayed graph relies on (fast/expert_graphs.py): the rows padded to a bucket
    past the offsets' last end, and an `out` buffer; the real rows equal the unpadded call,
    the padding's rows of out keep their poison, in groups and in one group."""
    from strata.engine.core.fast.expert_graphs import bucket_rows
    from strata.engine.core.quant import expert_grouped

    hidden, inter = BLOCK32_SHAPE
    blocks, _ = _layer((QT.Q8_0, QT.Q4_0, QT.Q8_0), hidden, inter)
    monkeypatch.setattr(expert_grouped, "EXPERT_SCRATCH_BYTES", group * 2 * inter * hidden * 4)
    rows, offsets, weights = _rows(hidden, seed=5)
    x, source = _shuffled(rows, seed=5)
    expected = expert_grouped.experts_mlp(x, source, offsets, weights, *blocks)
    num_rows = source.shape[0]
    bucket = 2 * num_rows  # any padding does; the graphs round up to a power of two
    assert bucket_rows(num_rows) >= num_rows
    padded_source = torch.cat([source, torch.zeros(bucket - num_rows, dtype=source.dtype)])
    padded_weights = torch.cat([weights, torch.full((bucket - num_rows,), float("nan"))])
    out = torch.full((bucket, hidden), float("nan"))
    got = expert_grouped.experts_mlp(x, padded_source, offsets, padded_weights, *blocks,
                                     out=out)
    assert got is out
    torch.testing.assert_close(out[:num_rows], expected, rtol=0, atol=0)
    assert out[num_rows:].isnan().all()
    with pytest.raises(ValueError, match="out must be"):
        expert_grouped.experts_mlp(x, source, offsets, weights, *blocks, out=out)


def test_row_buckets_are_powers_of_two_from_a_floor() -> None:
    from strata.engine.core.fast.expert_graphs import MIN_BUCKET_ROWS, bucket_rows

    assert bucket_rows(1) == MIN_BUCKET_ROWS
    assert bucket_rows(4096) == 4096 and bucket_rows(4097) == 8192
    assert all(bucket_rows(n) >= n and bucket_rows(n) & (bucket_rows(n) - 1) == 0
               for n in range(1, 40000, 997))
