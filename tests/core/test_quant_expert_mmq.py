"""The int8 tensor-core grouped GEMMs over Q4_K, Q6_K and Q8_0 experts (quant/expert_mmq.py)
through Triton's CPU interpreter: rows sorted by expert (test_quant_expert_gemm's routing,
with empty experts and several M tiles), against float64 torch on gguf-py's dequantized
experts times the rows as quantize_x rounds them to int8; mixed types in one layer; what
the kernels refuse. tests/gpu/test_quant_expert_mmq_cuda.py repeats them on the GPU at
Qwen3-30B-A3B's shape.
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

import torch.nn.functional as F
from gguf import GGMLQuantizationType as QT

from tests.core.test_quant_expert_gemm import COUNTS, _assert_close, _layer, _rows

# Float32 sums of exact integer products: only the order differs from float64.
REL_TOL = 2e-5
SHAPE = (512, 256)  # H, I: two Q4_K/Q6_K super-blocks along H


def int8_rounded(x: torch.Tensor) -> torch.Tensor:
    """x [R, K] as the kernels see it: quantize_x's int8 times its scale per 32 values."""
    from strata.engine.core.quant import gemv_dp4a

    q, d, _, _ = gemv_dp4a.quantize_x(x.contiguous())
    return (q.double().view(x.shape[0], -1, 32) * d.double()[:, :, None]).view(x.shape)


def _reference(rows, offsets, weights, dense, act=None):
    """(act [R, I], y [R, H]) per expert in float64 from int8-rounded rows; with act given,
    y from that act (rounded likewise), so the down kernel is checked on its own input."""
    gate, up, down = (d.double() for d in dense)
    x_all = int8_rounded(rows)
    acts, ys = [], []
    begin = 0
    for expert, end in enumerate(offsets.tolist()):
        x = x_all[begin:end]
        part = F.silu(x @ gate[expert].T) * (x @ up[expert].T) * weights[begin:end, None].double()
        acts.append(part)
        begin = end
    act_ref = torch.cat(acts)
    a_all = int8_rounded((act_ref if act is None else act).float())
    begin = 0
    for expert, end in enumerate(offsets.tolist()):
        ys.append(a_all[begin:end] @ down[expert].T)
        begin = end
    return act_ref, torch.cat(ys)


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q6_K, QT.Q8_0], ids=lambda t: t.name)
def test_int8_grouped_gemm_matches_torch_on_int8_rounded_rows(qtype: QT) -> None:
    from strata.engine.core.quant import expert_mmq

    blocks, dense = _layer((qtype,) * 3, *SHAPE)
    assert expert_mmq.supports(*blocks)
    rows, offsets, weights = _rows(SHAPE[0], seed=int(qtype))
    act = expert_mmq.gate_up(rows, offsets, blocks[0], blocks[1], weights)
    act_expected, _ = _reference(rows, offsets, weights, dense)
    assert act.shape == (sum(COUNTS), SHAPE[1]) and act.dtype == rows.dtype
    _assert_close(act, act_expected, REL_TOL)
    y = expert_mmq.down(act, offsets, blocks[2])
    _, y_expected = _reference(rows, offsets, weights, dense, act=act)
    assert y.shape == rows.shape
    _assert_close(y, y_expected, REL_TOL)


def test_mixed_types_in_one_layer_and_close_to_the_float_rows() -> None:
    """Q4_K_M's mix (gate Q4_K, up Q8_0, down Q6_K) in one launch each; and the int8 rows'
    result within 2% of float rows' (what expert_gemm computes)."""
    from strata.engine.core.quant import expert_gemm, expert_mmq

    blocks, dense = _layer((QT.Q4_K, QT.Q8_0, QT.Q6_K), *SHAPE)
    rows, offsets, weights = _rows(SHAPE[0], seed=5)
    act_expected, _ = _reference(rows, offsets, weights, dense)
    got = expert_mmq.experts_mlp(rows, *blocks, offsets, weights)
    act = expert_mmq.gate_up(rows, offsets, blocks[0], blocks[1], weights)
    _assert_close(act, act_expected, REL_TOL)
    _, y_expected = _reference(rows, offsets, weights, dense, act=act)
    _assert_close(got, y_expected, REL_TOL)
    floats = expert_gemm.experts_mlp(rows, *blocks, offsets, weights)
    _assert_close(got, floats.double(), 2e-2)


def test_types_and_rows_it_cannot_take_are_refused() -> None:
    from strata.engine.core.quant import expert_mmq

    blocks, _ = _layer((QT.Q4_0,) * 3, 544, 96)
    assert not expert_mmq.supports(*blocks)
    blocks, _ = _layer((QT.Q8_0,) * 3, *SHAPE)
    rows, offsets, weights = _rows(SHAPE[0])
    with pytest.raises(ValueError, match="disagree"):
        expert_mmq.gate_up(rows[:, :64], offsets, blocks[0], blocks[1], weights)
    empty = expert_mmq.experts_mlp(rows[:0], *blocks, torch.zeros_like(offsets), weights[:0])
    assert empty.shape == (0, SHAPE[0])
