"""The grouped GEMMs over quantized experts (quant/expert_gemm.py) through Triton's CPU
interpreter: rows sorted by expert, with experts of no rows and of more rows than a BLOCK_M
tile, against torch on gguf-py's dequantized experts for planes types (Q4_K, Q6_K, Q8_0,
Q4_0, Q2_K, IQ2_XXS through the lookup table) and a type only dequant_tile.py decodes
(IQ4_XS); bf16 rows against the old path's math (moe_prefill._grouped); mixed and
misaligned layouts; and a tiny quantized Qwen3-MoE's prefill logits through the engine path
against the dequantize-then-GEMM path. tests/gpu/test_quant_expert_gemm_cuda.py repeats the
kernels on the GPU at Qwen3-30B-A3B's shape.
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

from strata.engine.core.quant.experts import QuantizedExperts
from tests.core.test_quant_expert_gemv import stack
from tests.helpers.call_counter import count_calls

# Rows per expert: none, fewer than a BLOCK_M tile (16 under the interpreter), several tiles
# and a partial one; first and last experts empty, so tiles start mid-way.
COUNTS = (0, 5, 37, 0, 16, 1, 0)
# Float32 throughout: only the summation order differs from the float64 reference.
REL_TOL = 2e-5
# 256-value super-blocks: H of 512 (two K tiles), I of 256; 32-value blocks: H = 544 and
# I = 96, partial K and output tiles of the interpreter's 128 x 256.
K_QUANT_SHAPE, BLOCK32_SHAPE = (512, 256), (544, 96)
BLOCK32_TYPES = (QT.Q8_0, QT.Q4_0)
PLANES_TYPES = (QT.Q4_K, QT.Q6_K, QT.Q8_0, QT.Q4_0, QT.Q2_K, QT.IQ2_XXS)


def _shape(qtype: QT) -> tuple[int, int]:
    return BLOCK32_SHAPE if qtype in BLOCK32_TYPES else K_QUANT_SHAPE


def _layer(types: tuple[QT, QT, QT], hidden: int, inter: int, pad_bytes: int = 0):
    """((gate, up, down) QuantizedExperts, their float32 references) of len(COUNTS) experts."""
    from tests.core import test_quant_expert_gemv as gemv

    num = len(COUNTS)
    saved, gemv.NUM_EXPERTS = gemv.NUM_EXPERTS, num
    try:
        made = [stack(types[0], inter, hidden, seed=1, pad_bytes=pad_bytes),
                stack(types[1], inter, hidden, seed=2, pad_bytes=pad_bytes),
                stack(types[2], hidden, inter, seed=3, pad_bytes=pad_bytes)]
    finally:
        gemv.NUM_EXPERTS = saved
    return tuple(m[0] for m in made), tuple(m[1] for m in made)


def _rows(hidden: int, dtype=torch.float32, seed: int = 0):
    """(rows [R, H], offsets [E] int32, row weights [R]) sorted by expert as COUNTS says."""
    gen = torch.Generator().manual_seed(seed)
    num_rows = sum(COUNTS)
    rows = (torch.randn(num_rows, hidden, generator=gen) * 0.02).to(dtype)
    weights = (torch.rand(num_rows, generator=gen) + 0.1).to(dtype)
    offsets = torch.tensor(COUNTS).cumsum(0).to(torch.int32)
    return rows, offsets, weights


def _reference(rows, offsets, weights, dense) -> tuple[torch.Tensor, torch.Tensor]:
    """(act [R, I], y [R, H]) per expert by torch in float64."""
    gate, up, down = (d.double() for d in dense)
    acts, ys = [], []
    begin = 0
    for expert, end in enumerate(offsets.tolist()):
        x = rows[begin:end].double()
        act = F.silu(x @ gate[expert].T) * (x @ up[expert].T) * weights[begin:end, None].double()
        acts.append(act)
        ys.append(act @ down[expert].T)
        begin = end
    return torch.cat(acts), torch.cat(ys)


def _assert_close(got: torch.Tensor, expected: torch.Tensor, rel: float = REL_TOL) -> None:
    error = (got.double() - expected).abs().max().item()
    assert error <= rel * expected.abs().max().item(), (error, expected.abs().max().item())


def test_the_test_routing_spans_empty_experts_and_several_tiles() -> None:
    from strata.engine.core.quant import expert_gemm

    block_m = expert_gemm.INTERPRETER_CONFIG[0][3]
    assert 0 in COUNTS and max(COUNTS) > 2 * block_m and block_m in COUNTS


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q6_K, QT.Q8_0, QT.Q4_0, QT.Q2_K, QT.IQ4_XS, QT.IQ2_XXS],
                         ids=lambda t: t.name)
def test_grouped_gemm_matches_torch_on_the_dequantized_experts(qtype: QT) -> None:
    from strata.engine.core.quant import expert_gemm

    hidden, inter = _shape(qtype)
    blocks, dense = _layer((qtype,) * 3, hidden, inter)
    assert expert_gemm.supports(*blocks)
    assert (expert_gemm.decoding(blocks[0])[0] > 0) == (qtype in PLANES_TYPES)
    rows, offsets, weights = _rows(hidden, seed=int(qtype))
    act_expected, y_expected = _reference(rows, offsets, weights, dense)
    act = expert_gemm.gate_up(rows, offsets, blocks[0], blocks[1], weights)
    assert act.shape == (sum(COUNTS), inter) and act.dtype == rows.dtype
    _assert_close(act, act_expected)
    y = expert_gemm.down(act, offsets, blocks[2])
    assert y.shape == rows.shape
    _assert_close(y, y_expected)


def test_mixed_types_and_a_misaligned_stride_in_one_layer() -> None:
    """Gate IQ4_XS (dequant_tile) and up IQ2_XXS (planes, lookup table) in one kernel, down
    Q6_K; then Q4_K experts 2 bytes apart mod 4, which the planes' word loads cannot take:
    decoded value by value instead, same result."""
    from strata.engine.core.quant import expert_gemm, expert_gemv

    blocks, dense = _layer((QT.IQ4_XS, QT.IQ2_XXS, QT.Q6_K), *K_QUANT_SHAPE)
    rows, offsets, weights = _rows(K_QUANT_SHAPE[0], seed=5)
    _, y_expected = _reference(rows, offsets, weights, dense)
    _assert_close(expert_gemm.experts_mlp(rows, *blocks, offsets, weights), y_expected)

    blocks, dense = _layer((QT.Q4_K,) * 3, *K_QUANT_SHAPE, pad_bytes=2)
    assert not expert_gemv.is_supported(blocks[0]) and expert_gemm.supports(*blocks)
    _, y_expected = _reference(rows, offsets, weights, dense)
    _assert_close(expert_gemm.experts_mlp(rows, *blocks, offsets, weights), y_expected)


def test_bf16_rows_round_like_the_dequantize_then_grouped_gemm_path() -> None:
    """bf16 rows and weights: products, SiLU and each multiply rounded where _grouped and
    silu_mul_scale round them (the dots themselves are float32 under the interpreter)."""
    from strata.engine.core.fast.moe_prefill import _grouped
    from strata.engine.core.fast.pointwise import EAGER_OPS
    from strata.engine.core.quant import expert_gemm

    hidden, inter = K_QUANT_SHAPE
    blocks, dense = _layer((QT.Q4_K, QT.Q4_K, QT.Q6_K), hidden, inter)
    blocks = tuple(QuantizedExperts(b.qtype, b.shape, b.raw, torch.bfloat16) for b in blocks)
    rows, offsets, weights = _rows(hidden, torch.bfloat16, seed=7)
    got = expert_gemm.experts_mlp(rows, *blocks, offsets, weights)
    assert got.dtype == torch.bfloat16
    expected = _grouped(rows, *(d.to(torch.bfloat16) for d in dense), offsets, weights,
                        EAGER_OPS)
    _assert_close(got, expected.double(), rel=2e-2)
    _, y64 = _reference(rows, offsets, weights, dense)
    _assert_close(got, y64, rel=2e-2)


def test_rows_that_fit_no_kernel_are_refused() -> None:
    from strata.engine.core.quant import expert_gemm

    blocks, _ = _layer((QT.Q8_0,) * 3, *BLOCK32_SHAPE)
    rows, offsets, weights = _rows(BLOCK32_SHAPE[0])
    with pytest.raises(ValueError, match="offsets"):
        expert_gemm.gate_up(rows, offsets.long(), blocks[0], blocks[1], weights)
    with pytest.raises(ValueError, match="rows"):
        expert_gemm.gate_up(rows[:, :64], offsets, blocks[0], blocks[1], weights)
    empty = expert_gemm.experts_mlp(rows[:0], *blocks, torch.zeros_like(offsets), weights[:0])
    assert empty.shape == (0, BLOCK32_SHAPE[0])


# ---- engine -------------------------------------------------------------------------------


# Random wide experts drive some gates far negative: exp(-g) overflows to inf, silu to -0.
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
def test_engine_prefill_through_the_grouped_kernels_matches_the_dequantizing_path(
        tmp_path, monkeypatch) -> None:
    """A tiny Qwen3-MoE whose experts mix I-quants, Q4_K and Q6_K (test_quant_experts.MIXED),
    all resident: a 23-token prompt in chunks of 16 through fast/prefill.py takes
    expert_gemm's kernels in every MoE layer, and its logits equal the old path's (each
    projection dequantized, then grouped GEMMs) within float32 summation order. The last
    row's one-token MoE takes the reference module in both runs: the interpreted one-token
    kernels cost seconds over I-quants, and test_quant_experts.py covers them."""
    from strata.engine.core.fast import moe_grouped, moe_prefill
    from strata.engine.core.fast.prefill import prefill
    from strata.engine.core.kv_cache import KVCache
    from strata.engine.core.quant import expert_gemm
    from tests.core.test_quant_experts import MIXED, PROMPT, _engine, _gguf

    path = _gguf(tmp_path, "qwen3_moe", "Q8_0", MIXED, wide=True)
    engine = _engine(path, monkeypatch, quantized=True)
    calls = count_calls(monkeypatch, expert_gemm, "experts_mlp")
    monkeypatch.setattr(moe_grouped, "experts_triton", lambda moe, x, *args: moe(x))
    try:
        model = engine.model
        assert engine.memory.expert_mode == "all"
        ids = torch.tensor(PROMPT)

        def logits() -> torch.Tensor:
            kv = KVCache.for_config(model.config, 64)
            return prefill(model, kv, ids, 0, chunk_tokens=16, moe_impl="triton")

        got = logits()
        # Both chunks' layers but the last: the first chunk's writes only K/V, the last
        # chunk's runs its one last row (the one-token kernels).
        num_calls = 2 * (len(model.model.layers) - 1)
        assert calls[0] == num_calls
        monkeypatch.setattr(moe_prefill, "decodes_in_gemm", lambda *experts: False)
        expected = logits()
        assert calls[0] == num_calls
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * expected.abs().max())
        assert got.argmax() == expected.argmax()
    finally:
        engine.close()
