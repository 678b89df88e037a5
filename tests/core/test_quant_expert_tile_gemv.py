"""One token's quantized experts through the tile decoder's GEMV (quant/expert_tile_gemv.py):
MXFP4 blocks (GPT-OSS) and a type with GPT-OSS's epilogue (expert biases, clamped SwiGLU),
resident or through a partial cache's slot table, against gguf-py's dequantized weights."""

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

import gguf
from gguf import GGMLQuantizationType as QT

from strata.engine.core.fast.expert_epilogue import Epilogue
from strata.engine.core.quant.experts import QuantizedExperts
from tests.helpers.quant_blocks import random_blocks

E, HIDDEN, INTER, TOP_K = 5, 64, 96, 3
LIMIT, ALPHA = 0.8, 1.702


def _stack(qtype: QT, rows: int, cols: int, seed: int):
    """(QuantizedExperts [E, rows, cols] of random blocks, float32 values gguf-py decodes)."""
    raw = random_blocks(qtype, E * rows, cols, seed, scale=0.05)
    values = torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(E, rows, cols).copy())
    blocks = torch.from_numpy(raw).view(E, rows, -1)
    return QuantizedExperts(qtype, (E, rows, cols), blocks, torch.float32), values


def _reference(x, values, ids, weights, epilogue):
    gate, up, down = values
    out = torch.zeros(HIDDEN)
    for j, e in enumerate(ids.tolist()):
        g, u = gate[e] @ x, up[e] @ x
        if epilogue is None:
            y = down[e] @ (torch.nn.functional.silu(g) * u)
        else:
            g, u = g + epilogue.gate_bias[e], u + epilogue.up_bias[e]
            y = down[e] @ epilogue.activate(g, u) + epilogue.down_bias[e]
        out += weights[j] * y
    return out


def _epilogue(seed: int) -> Epilogue:
    gen = torch.Generator().manual_seed(seed)
    return Epilogue(torch.randn(E, INTER, generator=gen) * 0.3,
                    torch.randn(E, INTER, generator=gen) * 0.3,
                    torch.randn(E, HIDDEN, generator=gen) * 0.3, LIMIT, ALPHA)


def _slots(host: QuantizedExperts, resident: dict[int, int], num_slots: int = 3):
    """(QuantizedExperts over num_slots garbage slots holding host's experts resident[e] ->
    slot, the table, the host copy's byte offset from the slots)."""
    slot_rows = torch.full((num_slots, host.expert_stride), 0x55, dtype=torch.uint8)
    table = torch.full((E,), -1, dtype=torch.int32)
    for expert, slot in resident.items():
        table[expert] = slot
        slot_rows[slot] = host.raw[expert].reshape(-1)
    _, rows, cols = host.shape
    row_bytes = host.raw.shape[2]
    slots = QuantizedExperts(host.qtype, (num_slots, rows, cols), slot_rows.as_strided(
        (num_slots, rows, row_bytes), (slot_rows.stride(0), row_bytes, 1)), host.dtype)
    return slots, table, host.raw.data_ptr() - slot_rows.data_ptr()


@pytest.mark.parametrize("qtype,with_epilogue,by_block", [
    (QT.MXFP4, True, None), (QT.MXFP4, False, None), (QT.MXFP4, True, True),
    (QT.MXFP4, True, False), (QT.Q8_0, True, None)])
def test_tile_gemv_matches_the_dequantized_experts(qtype, with_epilogue, by_block) -> None:
    """by_block None: the launch a model takes (its tuned tiles); else tiles given, MXFP4
    read a block at a time or by the generic tile decoder, 4 blocks a step: HIDDEN is 2
    blocks and INTER 3 a row, so the mask cuts the step."""
    from strata.engine.core.quant import expert_tile_gemv

    tiles = None if by_block is None else expert_tile_gemv.Tiles(8, 16, 128, by_block)
    stacks = [_stack(qtype, INTER, HIDDEN, 1), _stack(qtype, INTER, HIDDEN, 2),
              _stack(qtype, HIDDEN, INTER, 3)]
    experts, values = [s[0] for s in stacks], [s[1] for s in stacks]
    epilogue = _epilogue(4) if with_epilogue else None
    assert expert_tile_gemv.takes(experts[0], epilogue)
    x = torch.randn(HIDDEN, generator=torch.Generator().manual_seed(5))
    ids = torch.tensor([4, 0, 2])
    weights = torch.tensor([0.5, 0.3, 0.2])
    expected = _reference(x, values, ids, weights, epilogue)
    got = expert_tile_gemv.routed_mlp(x, *experts, ids, weights, epilogue=epilogue,
                                      tiles=tiles)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    if with_epilogue:  # the clamp binds: some gate or up value lies past the limit
        gate = torch.stack([values[0][e] @ x for e in ids.tolist()])
        assert (gate.abs() > LIMIT).any()
    # A partial cache: experts 4 and 2 in slots (garbage elsewhere), 0 from the host copy.
    layout = [_slots(w, {4: 2, 2: 0}) for w in experts]
    table = layout[0][1]
    got = expert_tile_gemv.routed_mlp(x, *(s for s, _, _ in layout), ids, weights, table,
                                      tuple(offset for _, _, offset in layout), epilogue,
                                      tiles)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_only_mxfp4_or_an_epilogue_takes_the_tile_gemv() -> None:
    from strata.engine.core.quant import expert_tile_gemv

    q8, _ = _stack(QT.Q8_0, INTER, HIDDEN, 1)
    mxfp4, _ = _stack(QT.MXFP4, INTER, HIDDEN, 1)
    assert not expert_tile_gemv.takes(q8, None)  # expert_gemv's dp4a/planes kernels read it
    assert expert_tile_gemv.takes(q8, _epilogue(1))
    assert expert_tile_gemv.takes(mxfp4, None)
