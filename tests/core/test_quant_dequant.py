"""The dequantizer (quant/dequant.py) through Triton's CPU interpreter: expert stacks into
strided outputs, partial tiles, misaligned blocks and a fixed tile, bit for bit against
gguf-py in float32. The whole-matrix cases of every type are in test_quant_kernels.py;
tests/gpu/test_quant_dequant_cuda.py repeats them compiled, at real shapes, per tile.
"""

from __future__ import annotations

import os

import numpy as np
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

from strata.engine.core.quant.experts import QuantizedExperts
from tests.helpers.quant_blocks import random_blocks

NUM_EXPERTS, ROWS = 3, 5


def _stack(qtype: QT, cols: int, pad_bytes: int, seed: int):
    """(QuantizedExperts [E, ROWS, cols] lying pad_bytes apart past their blocks, gguf-py's
    float32 values [E, ROWS, cols])."""
    raw = random_blocks(qtype, NUM_EXPERTS * ROWS, cols, seed)
    expected = gguf.quants.dequantize(raw, qtype).reshape(NUM_EXPERTS, ROWS, cols)
    row_bytes = raw.shape[1]
    padded = torch.zeros(NUM_EXPERTS, ROWS * row_bytes + pad_bytes, dtype=torch.uint8)
    padded[:, : ROWS * row_bytes] = torch.from_numpy(raw).view(NUM_EXPERTS, -1)
    view = padded.as_strided((NUM_EXPERTS, ROWS, row_bytes), (padded.stride(0), row_bytes, 1))
    return QuantizedExperts(qtype, (NUM_EXPERTS, ROWS, cols), view, torch.float32), expected


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q6_K, QT.Q5_1, QT.Q8_0, QT.IQ4_XS],
                         ids=lambda t: t.name)
def test_experts_land_side_by_side_in_a_strided_output(qtype: QT) -> None:
    """Experts 1..2 of a padded stack into the second half of each [2 * ROWS, K] matrix, as
    the MoE prefill puts up beside gate; K = 768 leaves the interpreter's 1024-column tile
    partly masked, ROWS = 5 its rows. The first half stays untouched."""
    from strata.engine.core.quant import dequant

    cols = 768
    experts, expected = _stack(qtype, cols, pad_bytes=16, seed=int(qtype))
    assert dequant.kernel_for(qtype, experts.raw, experts.expert_stride) == (
        "tile" if qtype == QT.IQ4_XS else "planes")
    out = torch.full((2, 2 * ROWS, cols), 7.0)
    dequant.dequantize_experts(experts, 1, out[:, ROWS:])
    np.testing.assert_array_equal(out[:, ROWS:].numpy(), expected[1:])
    assert bool((out[:, :ROWS] == 7.0).all())


def test_blocks_misaligned_for_word_loads_take_the_per_value_decode() -> None:
    """Q4_K experts 2 bytes apart mod 4: the planes' int32 scale words would fault, so the
    per-value decode runs, with the same values."""
    from strata.engine.core.quant import dequant

    experts, expected = _stack(QT.Q4_K, 256, pad_bytes=2, seed=1)
    assert dequant.kernel_for(QT.Q4_K, experts.raw, experts.expert_stride) == "tile"
    out = torch.empty(NUM_EXPERTS, ROWS, 256)
    np.testing.assert_array_equal(dequant.dequantize_experts(experts, 0, out).numpy(), expected)


@pytest.mark.parametrize("qtype", [QT.Q6_K, QT.Q4_0], ids=lambda t: t.name)
def test_a_fixed_tile_and_the_old_per_value_decode_give_the_same_values(qtype: QT) -> None:
    """What the GPU test and the bench run per candidate: the bare kernel at a given tile."""
    from strata.engine.core.quant import dequant

    raw = torch.from_numpy(random_blocks(qtype, 40, 512, seed=2))
    expected = gguf.quants.dequantize(raw.numpy(), qtype)
    for fixed in (("planes", (32, 256, 4)), ("tile", (16, 256, 4))):
        got = dequant.dequantize(raw, qtype, 512, torch.float32, fixed=fixed)
        np.testing.assert_array_equal(got.numpy(), expected)


def test_outputs_that_do_not_fit_are_refused() -> None:
    from strata.engine.core.quant import dequant

    experts, _ = _stack(QT.Q8_0, 64, pad_bytes=0, seed=3)
    with pytest.raises(ValueError, match=r"cannot take experts 2\.\.3"):
        dequant.dequantize_experts(experts, 2, torch.empty(2, ROWS, 64))
    raw = experts.raw[0]
    with pytest.raises(ValueError, match=r"contiguous \[5, 64\]"):
        dequant.dequantize(raw, QT.Q8_0, 64, torch.float32, out=torch.empty(64, 5).T)
