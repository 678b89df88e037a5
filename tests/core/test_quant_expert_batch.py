"""The batched routed-expert kernels over GGML blocks (quant/expert_batch.py) through Triton's
CPU interpreter, float32: B rows' gate/up and down + in-order sum against torch on gguf-py's
dequantized experts, for Q4_K_M's mix and other planes types, rows sharing experts (one
leader decodes for all by tl.dot), rows on experts of their own (multiply-and-add), every
row on one expert set, a partial cache's slot table (bit for bit the stacked result), and
the one-token kernels row by row. The GPU twin is
tests/gpu/test_quant_expert_batch_cuda.py; the engine-level batch in
test_quant_batch_decode.py.
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

from tests.core.test_quant_expert_gemv import (
    NUM_EXPERTS,
    _projections,
    assert_close,
    in_slots,
    reference,
    slot_table,
)


def _rows(num_rows: int, hidden: int, seed: int) -> torch.Tensor:
    """Small rows (gate stays on silu's curve), a few repeating row 0 like a bucket's padding."""
    x = torch.randn(num_rows, hidden, generator=torch.Generator().manual_seed(seed)) * 0.02
    if num_rows > 2:
        x[num_rows // 2 :: 3] = x[0]
    return x


def _routing(num_rows: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, k] distinct per row, from few experts so rows share them; weights [T, k]."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(NUM_EXPERTS, generator=gen)[:k] for _ in range(num_rows)])
    weights = torch.rand(num_rows, k, generator=gen) + 0.1
    return ids, weights / weights.sum(dim=1, keepdim=True)


def _expected(x, dense, ids, weights) -> tuple[torch.Tensor, torch.Tensor]:
    """(act [T*k, I], y [T, H]) row by row in float64."""
    acts, ys = zip(*(reference(x[t], *dense, ids[t], weights[t]) for t in range(x.shape[0])))
    return torch.cat(acts), torch.stack(ys)


@pytest.mark.parametrize(("types", "num_rows", "k"), [
    ((QT.Q4_K, QT.Q4_K, QT.Q6_K), 3, 8),  # Q4_K_M's experts
    ((QT.Q4_K, QT.Q4_K, QT.Q4_K), 16, 2),  # Q4_K_M's other layers; a full bucket
    ((QT.Q5_0, QT.Q4_1, QT.Q8_0), 4, 3),  # 32-value blocks
    ((QT.IQ2_XXS, QT.IQ2_XXS, QT.Q2_K), 3, 8),  # the IQ2_XXS mix (lookup-table planes)
], ids=["q4k-q4k-q6k", "q4k-16rows", "q5_0-q4_1-q8_0", "iq2xxs-iq2xxs-q2k"])
def test_batched_experts_match_torch_on_the_dequantized_experts(types, num_rows, k) -> None:
    from strata.engine.core.quant import expert_batch

    # One 256-value super-block a row for K-quants (the interpreter pays per op); 32-value
    # blocks over partial row and column tiles.
    wide = any(t in (QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.Q2_K, QT.IQ2_XXS) for t in types)
    hidden, inter = (256, 256) if wide else (288, 96)
    blocks, dense = _projections(*types, hidden, inter)
    assert expert_batch.supports(*blocks)
    ids, weights = _routing(num_rows, k, seed=num_rows + k)
    x = _rows(num_rows, hidden, seed=k)
    act_expected, y_expected = _expected(x, dense, ids, weights)
    act = expert_batch.gate_up_rows(x, blocks[0], blocks[1], ids)
    assert act.shape == (num_rows * k, inter) and act.dtype == x.dtype
    assert_close(act, act_expected)
    parts = expert_batch.down_rows(act, blocks[2], ids, weights)  # [T*k, H] float32
    y = expert_batch.sum_parts(parts, k, x.dtype)
    assert y.shape == (num_rows, hidden) and y.dtype == x.dtype
    assert_close(y, y_expected)


def test_one_leader_serves_every_row_of_one_expert_set() -> None:
    """All 16 rows on the same experts (padding rows all carry token 0): one leader each."""
    from strata.engine.core.quant import expert_batch, expert_gemv

    blocks, dense = _projections(QT.Q4_K, QT.Q4_K, QT.Q6_K, hidden=256, inter=256)
    ids = torch.tensor([[4, 1, 7]] * 16)
    weights = torch.rand(16, 3, generator=torch.Generator().manual_seed(2)) + 0.1
    x = _rows(16, 256, seed=3)
    _, y_expected = _expected(x, dense, ids, weights)
    y = expert_batch.routed_rows(x, *blocks, ids, weights)
    assert_close(y, y_expected)
    # The one-token kernels: the same values up to the summation order.
    one = expert_gemv.routed_mlp(x[15], *blocks, ids[15], weights[15])
    assert_close(y[15], one.double())


def test_rows_on_experts_of_their_own_match_the_one_token_kernels() -> None:
    """No expert shared (each leader has one row: the multiply-and-add loop, not tl.dot)."""
    from strata.engine.core.quant import expert_batch, expert_gemv

    blocks, dense = _projections(QT.Q4_K, QT.Q8_0, QT.Q6_K, hidden=256, inter=256)
    ids = torch.tensor([[0, 5, 2], [3, 8, 6]])
    weights = torch.rand(2, 3, generator=torch.Generator().manual_seed(7)) + 0.1
    x = _rows(2, 256, seed=8)
    _, y_expected = _expected(x, dense, ids, weights)
    y = expert_batch.routed_rows(x, *blocks, ids, weights)
    assert_close(y, y_expected)
    for t in range(2):
        assert_close(y[t], expert_gemv.routed_mlp(x[t], *blocks, ids[t], weights[t]).double())


def test_batched_experts_read_slots_or_the_host_copy_through_the_table() -> None:
    """A partial cache: experts 4, 1 and 7 in slots 2, 0 and 3 (slot 1 garbage), the others
    read in place from the host copy (experts 36 padding bytes apart); garbage wherever the
    other copy is to be read. The result equals the stacked layout's bit for bit."""
    from strata.engine.core.quant import expert_batch

    host, dense = _projections(QT.Q4_K, QT.Q8_0, QT.Q6_K, 256, 256, pad_bytes=36)
    resident = {4: 2, 1: 0, 7: 3}
    slots, offsets = zip(*(in_slots(w, resident) for w in host))
    table = slot_table(resident)
    assert expert_batch.supports(*slots, table, offsets)
    ids = torch.tensor([[4, 5, 1], [0, 7, 2], [4, 8, 6], [5, 1, 0]])  # slot and host, shared
    weights = torch.rand(4, 3, generator=torch.Generator().manual_seed(5)) + 0.1
    x = _rows(4, 256, seed=6)
    _, y_expected = _expected(x, dense, ids, weights)
    stacked = expert_batch.routed_rows(x, *host, ids, weights)
    for w in host:  # the resident experts' host blocks garbage: only their slots are right
        for expert in resident:
            w.raw[expert].fill_(0x55)
    y = expert_batch.routed_rows(x, *slots, ids, weights, table, offsets)
    assert_close(y, y_expected)
    torch.testing.assert_close(y, stacked, rtol=0, atol=0)


def test_more_rows_than_a_leader_multiplies_are_refused() -> None:
    from strata.engine.core.quant import expert_batch

    blocks, _ = _projections(QT.Q8_0, QT.Q8_0, QT.Q8_0, 288, 96)
    with pytest.raises(ValueError, match=r"1\.\.16 rows"):
        expert_batch.gate_up_rows(torch.zeros(17, 288), blocks[0], blocks[1],
                                  torch.zeros(17, 2, dtype=torch.long))
