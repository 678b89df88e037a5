"""The int8 grouped GEMMs over quantized experts (quant/expert_mmq.py, mmq_groups.py) through
Triton's CPU interpreter: rows rounded to int8 per 32 exactly as a torch rounding says; each
type's product against torch on gguf-py's dequantized experts and the same int8 rows (the
integer sums are exact, so only float32 rounding differs); experts with no rows and with
more rows than a BLOCK_M tile (test_quant_expert_gemm's routing); the whole SwiGLU against
the float path within what the int8 rounding explains; and moe_prefill's opt-in switch.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

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

from tests.core.test_quant_expert_gemm import COUNTS, _layer, _reference, _rows
from tests.helpers.call_counter import count_calls
from tests.helpers.int8_rows import dequantized, round_int8

TYPES = (QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1)
K_QUANTS = (QT.Q4_K, QT.Q5_K, QT.Q6_K)
# Outputs 96: a partial tile of the interpreter's 128. Inputs: two 256-value blocks,
# or 17 groups of 32 (a last pair of one group).
OUTPUTS, K_QUANT_COLS, BLOCK32_COLS = 96, 512, 544
REL_TOL = 1e-5  # float32 scale products and sums against float64


def _per_expert(x: torch.Tensor, offsets: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    """x [R, K] @ dense[e]^T per expert's rows, float64."""
    out, begin = [], 0
    for expert, end in enumerate(offsets.tolist()):
        out.append(x[begin:end].double() @ dense[expert].double().T)
        begin = end
    return torch.cat(out)


def _assert_close(got: torch.Tensor, expected: torch.Tensor, rel: float = REL_TOL) -> None:
    error = (got.double() - expected).abs().max().item()
    assert error <= rel * expected.abs().max().item(), (error, expected.abs().max().item())


def test_rows_round_to_int8_as_the_torch_rounding() -> None:
    from strata.engine.core.quant import expert_mmq

    x = torch.randn(37, 96, generator=torch.Generator().manual_seed(3)) * 0.05
    x[1, 32:64] = 0.0  # a group of zeros: scale 0, no division by it
    x[2, 5] = 127.5 / 127.0 * x[2, :32].abs().max()  # becomes the max: ends exactly on 127
    q, d, s = expert_mmq.quantize_rows(x)
    q_ref, d_ref, s_ref = round_int8(x)
    assert torch.equal(q, q_ref) and torch.equal(d, d_ref)
    torch.testing.assert_close(s, s_ref, rtol=0, atol=0)
    assert d[1, 1] == 0 and (q[1, 32:64] == 0).all()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_each_type_matches_torch_on_dequantized_experts_and_the_int8_rows(qtype: QT) -> None:
    """down (one projection) over [E, 96, K] experts of qtype: every expert's rows, their
    int8 rounding times gguf-py's dequantized weights in float64."""
    from strata.engine.core.quant import expert_mmq

    cols = K_QUANT_COLS if qtype in K_QUANTS else BLOCK32_COLS
    blocks, dense = _layer((QT.Q8_0, QT.Q8_0, qtype), OUTPUTS, cols)  # down: [E, 96, cols]
    assert expert_mmq.is_supported(blocks[2])
    rows, offsets, _ = _rows(cols, seed=int(qtype))
    rounded = expert_mmq.quantize_rows(rows)
    expected = _per_expert(dequantized(rounded), offsets, dense[2])
    got = expert_mmq.down(rounded, offsets, blocks[2], torch.float32)
    assert got.shape == (sum(COUNTS), OUTPUTS) and got.dtype == torch.float32
    _assert_close(got, expected)


@pytest.mark.parametrize("gate_type", [QT.Q4_K, QT.Q5_0], ids=lambda t: t.name)
def test_gate_up_rounds_the_activation_to_int8_per_32(gate_type: QT) -> None:
    """GLM-4.5-Air's gate and up (Q4_K; or gate Q5_0, whose tile reads x interleaved, up
    not): the SwiGLU of the int8 rows, weighted, then its own int8 rounding: each value
    within half a step of its group's scale."""
    from strata.engine.core.quant import expert_mmq

    blocks, dense = _layer((gate_type, QT.Q4_K, QT.Q5_0), K_QUANT_COLS, 2 * OUTPUTS)
    rows, offsets, weights = _rows(K_QUANT_COLS, seed=11)
    rounded = expert_mmq.quantize_rows(rows)
    x = dequantized(rounded)
    act = (F.silu(_per_expert(x, offsets, dense[0])) * _per_expert(x, offsets, dense[1])
           * weights.double()[:, None])
    q, d, s = expert_mmq.gate_up(rounded, offsets, blocks[0], blocks[1], weights)
    assert q.shape == act.shape and q.dtype == torch.int8 and d.shape == (act.shape[0], 6)
    step = d.double().repeat_interleave(32, dim=1)
    error = (dequantized((q, d, s)) - act).abs()
    assert (error <= 0.5 * step + REL_TOL * act.abs().max()).all(), error.max()
    assert torch.equal(s, d * q.view(q.shape[0], -1, 32).float().sum(-1))


@pytest.mark.parametrize("types", [(QT.Q4_K, QT.Q4_K, QT.Q5_0), (QT.Q4_K, QT.Q4_K, QT.Q6_K)],
                         ids=["glm-4.5-air", "qwen3"])
def test_experts_mlp_within_the_int8_rounding_of_the_float_path(types) -> None:
    """The whole weighted SwiGLU against float64 on the dequantized experts, within the int8
    rounding of the rows and the activation (each about 1/254 of a group's largest value);
    tokens gathered by `source` give the same bits as the gathered rows."""
    from strata.engine.core.quant import expert_mmq

    blocks, dense = _layer(types, 256, 256)  # one 256-value block each way
    rows, offsets, weights = _rows(256, seed=13)
    tokens = rows[::2].contiguous()  # each token routed to two rows
    source = torch.arange(rows.shape[0]) // 2
    _, expected = _reference(tokens[source], offsets, weights, dense)
    got = expert_mmq.experts_mlp(tokens[source], *blocks, offsets, weights)
    assert got.shape == rows.shape
    _assert_close(got, expected, rel=2e-2)
    gathered = expert_mmq.experts_mlp(tokens, *blocks, offsets, weights, source=source)
    assert torch.equal(gathered, got)


def test_gate_up_in_the_rows_dtype_then_expert_gemms_down() -> None:
    """down_by="gemm": gate/up writes the activation in the rows' dtype (bf16: within its
    roundings of the float64 SwiGLU of the int8 rows; the values its int8 output rounds, up
    to a float32 tie), and expert_gemm.down multiplies it, as experts_mlp returns."""
    from strata.engine.core.quant import expert_gemm, expert_mmq

    blocks, dense = _layer((QT.Q4_K, QT.Q4_K, QT.Q5_0), 256, 2 * OUTPUTS)
    rows, offsets, weights = _rows(256, seed=19)
    rows, weights = rows.bfloat16(), weights.bfloat16()
    rounded = expert_mmq.quantize_rows(rows)
    x = dequantized(rounded)
    expected = (F.silu(_per_expert(x, offsets, dense[0])) * _per_expert(x, offsets, dense[1])
                * weights.double()[:, None])
    act = expert_mmq.gate_up(rounded, offsets, blocks[0], blocks[1], weights, int8_out=False)
    assert act.dtype == torch.bfloat16 and act.shape == expected.shape
    error = (act.double() - expected).abs().max().item()
    assert error <= 2.0**-6 * expected.abs().max().item(), error  # a few bf16 steps
    q, d, _ = expert_mmq.gate_up(rounded, offsets, blocks[0], blocks[1], weights)
    q_ref, d_ref, _ = round_int8(act.float())
    assert torch.equal(d, d_ref) and (q.int() - q_ref.int()).abs().max() <= 1
    got = expert_mmq.experts_mlp(rows, *blocks, offsets, weights, down_by="gemm")
    assert torch.equal(got, expert_gemm.down(act, offsets, blocks[2]))
    with pytest.raises(ValueError, match="down_by"):
        expert_mmq.experts_mlp(rows, *blocks, offsets, weights, down_by="cpu")


def test_types_and_layouts_it_cannot_read_are_refused() -> None:
    from strata.engine.core.quant import expert_mmq

    blocks, _ = _layer((QT.Q2_K, QT.IQ4_XS, QT.Q4_K), K_QUANT_COLS, 256)
    assert not expert_mmq.supports(*blocks) and expert_mmq.is_supported(blocks[2])
    misaligned, _ = _layer((QT.Q4_K,) * 3, K_QUANT_COLS, 256, pad_bytes=2)
    assert not expert_mmq.is_supported(misaligned[0])  # its scales are read as words
    rows, offsets, weights = _rows(K_QUANT_COLS)
    rounded = expert_mmq.quantize_rows(rows[:, :256].contiguous())  # down's inputs
    with pytest.raises(ValueError, match="no int8 kernel"):
        expert_mmq.down(rounded, offsets, misaligned[2], torch.float32)
    with pytest.raises(ValueError, match="offsets"):
        expert_mmq.down(rounded, offsets.long(), blocks[2], torch.float32)
    with pytest.raises(ValueError, match="rounded"):
        expert_mmq.down((rounded[0][:, :64], *rounded[1:]), offsets, blocks[2], torch.float32)
    q8_0, _ = _layer((QT.Q8_0,) * 3, K_QUANT_COLS, OUTPUTS)
    empty = expert_mmq.experts_mlp(rows[:0], *q8_0, torch.zeros_like(offsets), weights[:0])
    assert empty.shape == (0, K_QUANT_COLS)


def test_moe_prefill_takes_it_only_when_switched_on(monkeypatch) -> None:
    """STRATA_EXPERT_MMQ=1: moe_prefill._quantized multiplies supported experts by
    expert_mmq (within its rounding of expert_gemm's result) and the load's warm-up runs it;
    unset, or a type it cannot read, it keeps expert_gemm. =gate_up: expert_mmq's gate/up
    and expert_gemm's down, for any down type expert_gemm decodes."""
    from strata.engine.core.fast import moe_prefill
    from strata.engine.core.quant import expert_mmq

    blocks, _ = _layer((QT.Q4_K, QT.Q4_K, QT.Q5_0), 256, 2 * OUTPUTS)
    rows, offsets, weights = _rows(256, seed=17)
    source = torch.arange(rows.shape[0])
    calls = count_calls(monkeypatch, expert_mmq, "experts_mlp")
    monkeypatch.delenv("STRATA_EXPERT_MMQ", raising=False)
    default = moe_prefill._quantized(rows, source, offsets, weights, blocks)
    assert calls[0] == 0
    monkeypatch.setenv("STRATA_EXPERT_MMQ", "1")
    got = moe_prefill._quantized(rows, source, offsets, weights, blocks)
    assert calls[0] == 1
    _assert_close(got, default.double(), rel=2e-2)
    other, _ = _layer((QT.Q4_K, QT.Q4_K, QT.Q2_K), 256, 256)
    moe_prefill._quantized(rows, source, offsets, weights, other)
    assert calls[0] == 1
    # The load's warm-up compiles it too (a first call inside a graph capture could not).
    moe = SimpleNamespace(top_k=2, plain_experts=True)
    moe_prefill.warm_up_quantized(moe, grouped=False, stacks=blocks)
    assert calls[0] == 2
    # gate_up: the int8 gate/up and expert_gemm's down, which also decodes Q2_K.
    monkeypatch.setenv("STRATA_EXPERT_MMQ", "gate_up")
    assert moe_prefill.mmq_down_by(other) == "gemm"
    mixed = moe_prefill._quantized(rows, source, offsets, weights, blocks)
    assert calls[0] == 3
    assert torch.equal(mixed, expert_mmq.experts_mlp(rows, *blocks, offsets, weights,
                                                     source=source, down_by="gemm"))


# ---- engine -------------------------------------------------------------------------------


# Random wide experts drive some gates far negative: exp(-g) overflows to inf, silu to -0.
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
def test_engine_prefill_with_the_switch_on_stays_within_the_int8_rounding(
        tmp_path, monkeypatch) -> None:
    """A tiny Qwen3-MoE in GLM-4.5-Air's and Qwen3's expert mixes (gate and up Q4_K, down
    Q5_0 and Q6_K on alternate layers), loaded with STRATA_EXPERT_MMQ=1: a 23-token prompt in
    chunks of 16 through fast/prefill.py takes expert_mmq in every MoE layer, and its logits
    stay within the int8 rounding of expert_gemm's (the switch off)."""
    from strata.engine.core.fast import moe_grouped
    from strata.engine.core.fast.prefill import prefill
    from strata.engine.core.kv_cache import KVCache
    from strata.engine.core.quant import expert_mmq
    from tests.core.test_quant_experts import PROMPT, _engine, _gguf
    from tests.helpers.quant_blocks import alternating_mix

    mix = alternating_mix(("Q4_K", "Q4_K", "Q5_0"), ("Q4_K", "Q4_K", "Q6_K"))
    path = _gguf(tmp_path, "qwen3_moe", "Q8_0", mix, wide=True)
    monkeypatch.setenv("STRATA_EXPERT_MMQ", "1")
    engine = _engine(path, monkeypatch, quantized=True)
    calls = count_calls(monkeypatch, expert_mmq, "experts_mlp")
    # The last row's one-token MoE: the reference module in both runs (not this path).
    monkeypatch.setattr(moe_grouped, "experts_triton", lambda moe, x, *args: moe(x))
    try:
        model = engine.model
        ids = torch.tensor(PROMPT)

        def logits() -> torch.Tensor:
            kv = KVCache.for_config(model.config, 64)
            return prefill(model, kv, ids, 0, chunk_tokens=16, moe_impl="triton")

        got = logits()
        assert calls[0] == 2 * (len(model.model.layers) - 1)  # as expert_gemm's engine test
        monkeypatch.delenv("STRATA_EXPERT_MMQ")
        expected = logits()
        assert calls[0] == 2 * (len(model.model.layers) - 1)
        _assert_close(got, expected.double(), rel=5e-2)
    finally:
        engine.close()
