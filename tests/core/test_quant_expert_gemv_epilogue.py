"""GPT-OSS's one-token experts by dp4a (quant/expert_gemv.py) through Triton's CPU
interpreter, dp4a, prmt and the funnel shift emulated: MXFP4 blocks (17 bytes: rows and
blocks at every byte mod 4) and a Q8_0 layer, with the epilogue (expert biases by the
real ids, the clamped SwiGLU) and without, resident and through a partial cache's slot
table, against gguf-py's dequantized experts times x and the activations as quantize_x
rounds them; and which path routed_experts picks. tests/gpu/test_moe_epilogue_cuda.py runs
gpt-oss-20b's layer compiled; test_quant_expert_tile_gemv.py the float path.
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

from strata.engine.core.fast.expert_epilogue import Epilogue
from tests.core.test_quant_dp4a import _int8_rounded
from tests.core.test_quant_expert_gemv import (
    NUM_EXPERTS,
    _dp4a_layer,
    _dp4a_x,
    assert_close,
    in_slots,
    slot_table,
)

# HIDDEN: 17 blocks, MXFP4 gate/up rows of 289 bytes; INTER: 3 blocks, down rows of 51: rows
# start at every byte mod 4; experts PAD = 2 bytes apart beyond their blocks (a stack's
# expert stride is even: QuantizedExperts), so they start at 0 and 2 mod 4.
HIDDEN, INTER, PAD = 544, 96, 2
LIMIT, ALPHA = 1.5, 1.702  # gpt-oss's alpha; a limit these random values pass
TOL = 2e-3  # fp16 outputs, float32 sums of the same integers


def _epilogue(seed: int, scale: float) -> Epilogue:
    gen = torch.Generator().manual_seed(seed)
    return Epilogue(*(torch.randn(NUM_EXPERTS, n, generator=gen) * scale
                      for n in (INTER, INTER, HIDDEN)), LIMIT, ALPHA)


def _reference(x, act, dense, ids, weights, epilogue):
    """(act [k, I], y [H]) in float64: gate and up of x rounded to int8 (+ biases), the
    epilogue's activation; down of the kernel's act rounded to int8 (+ its bias)."""
    gate, up, down = (w[ids.long()].double() for w in dense)
    xr = _int8_rounded(x[None])[0].double()
    g, u = gate @ xr, up @ xr
    y = down @ _int8_rounded(act).double()[:, :, None]  # [k, H, 1]
    y = y[:, :, 0]
    if epilogue is None:
        return torch.nn.functional.silu(g) * u, (y * weights.double()[:, None]).sum(0)
    rows = ids.long()
    g, u = g + epilogue.gate_bias[rows].double(), u + epilogue.up_bias[rows].double()
    y = y + epilogue.down_bias[rows].double()
    return epilogue.activate(g, u), (y * weights.double()[:, None]).sum(0)


@pytest.mark.parametrize("qtype,with_epilogue", [(QT.MXFP4, True), (QT.MXFP4, False),
                                                 (QT.Q8_0, True)],
                         ids=["MXFP4-epilogue", "MXFP4-plain", "Q8_0-epilogue"])
def test_dp4a_experts_with_the_epilogue_equal_the_dequantized_experts(qtype, with_epilogue):
    from strata.engine.core.quant import expert_gemv

    blocks, dense = _dp4a_layer((qtype,) * 3, HIDDEN, INTER, PAD)
    x = _dp4a_x(HIDDEN, seed=1) * 8  # gate and up past the clamp's limit somewhere
    epilogue = _epilogue(2, scale=2.0) if with_epilogue else None
    assert expert_gemv.supports_dp4a(*blocks, x)
    assert expert_gemv.takes(*blocks, x, epilogue=epilogue)
    ids = torch.tensor([4, 0, 7])
    weights = torch.tensor([0.5, 0.3, 0.2]).half()
    act = expert_gemv.gate_up(x, blocks[0], blocks[1], ids, epilogue=epilogue)
    y = expert_gemv.down_sum(act, blocks[2], ids, weights, epilogue=epilogue)
    act_expected, y_expected = _reference(x, act, dense, ids, weights, epilogue)
    assert_close(act, act_expected, TOL)
    assert_close(y, y_expected, TOL)
    if with_epilogue:  # the clamp binds: some biased gate or up value lies past the limit
        xr = _int8_rounded(x[None])[0].double()
        gate = dense[0][ids.long()].double() @ xr + epilogue.gate_bias[ids.long()].double()
        assert (gate.abs() > LIMIT).any()
    torch.testing.assert_close(expert_gemv.routed_mlp(x, *blocks, ids, weights,
                                                      epilogue=epilogue), y, rtol=0, atol=0)


def test_mxfp4_dp4a_experts_read_slots_or_the_host_copy_like_the_resident_ones() -> None:
    """A partial cache over MXFP4 experts (rows at odd bytes): the same sum as all resident, bit
    for bit; the biases are read by the real ids, not the slots."""
    from strata.engine.core.quant import expert_gemv

    host, _ = _dp4a_layer((QT.MXFP4,) * 3, HIDDEN, INTER, PAD)
    resident = {4: 2, 1: 0}
    slots, offsets = zip(*(in_slots(w, resident) for w in host))
    table = slot_table(resident)
    ids = torch.tensor([4, 5, 1])  # slot, host (an odd expert: at 2 mod 4), slot
    weights = torch.tensor([0.5, 0.3, 0.2]).half()
    x = _dp4a_x(HIDDEN, seed=3) * 8
    epilogue = _epilogue(5, scale=2.0)
    stacked = expert_gemv.routed_mlp(x, *host, ids, weights, epilogue=epilogue)
    for w in host:  # the resident experts' host blocks garbage: only their slots are right
        for expert in resident:
            w.raw[expert].fill_(0x55)
    assert expert_gemv.takes(*slots, x, table, offsets, epilogue)
    y = expert_gemv.routed_mlp(x, *slots, ids, weights, table, offsets, epilogue=epilogue)
    torch.testing.assert_close(y, stacked, rtol=0, atol=0)


def test_routed_experts_take_dp4a_for_half_x_and_the_tile_gemv_for_float32(monkeypatch):
    """moe_grouped.routed_experts: MXFP4 (or an epilogue over dp4a types) with fp16 x by
    expert_gemv, float32 x or STRATA_DP4A=0 by expert_tile_gemv; an epilogue over a
    planes-only type (Q2_K) by expert_tile_gemv too."""
    from strata.engine.core.fast import moe_grouped
    from strata.engine.core.quant import expert_gemv, expert_tile_gemv

    blocks, _ = _dp4a_layer((QT.MXFP4,) * 3, HIDDEN, INTER, PAD)
    x = _dp4a_x(HIDDEN, seed=4)[None]
    ids = torch.tensor([2, 6])
    weights = torch.tensor([0.6, 0.4]).half()
    epilogue = _epilogue(6, scale=0.5)
    calls = []
    for module in (expert_gemv, expert_tile_gemv):
        original = module.routed_mlp
        monkeypatch.setattr(module, "routed_mlp",
                            lambda *a, _m=module, _f=original, **k: calls.append(_m) or _f(*a, **k))
    for v in (x, x.float()):
        moe_grouped.routed_experts(v, *blocks, ids, weights, epilogue=epilogue)
    monkeypatch.setenv("STRATA_DP4A", "0")
    moe_grouped.routed_experts(x, *blocks, ids, weights, epilogue=epilogue)
    assert calls == [expert_gemv, expert_tile_gemv, expert_tile_gemv]
    monkeypatch.delenv("STRATA_DP4A")
    q2k, _ = _dp4a_layer((QT.Q2_K,) * 3, 512, 256, 4)
    assert expert_gemv.takes(*q2k, x) and not expert_gemv.takes(*q2k, x, epilogue=epilogue)
    # MXFP4 has a planes decoding too (gemv_planes): float32 x reads the blocks there, int8
    # x by dp4a; the two agree within x's int8 rounding.
    planes = expert_gemv.gate_up(x[0].float(), blocks[0], blocks[1], ids).float()
    by_dp4a = expert_gemv.gate_up(x[0], blocks[0], blocks[1], ids).float()
    assert (planes - by_dp4a).norm() <= 0.05 * planes.norm()
