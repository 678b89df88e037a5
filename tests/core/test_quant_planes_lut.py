"""gemv_planes.planes_lut (the planes decoding of types that read lookup.py's table, and of
every planes type through it) against gguf-py, bit for bit, through Triton's interpreter: a
test kernel scatters both planes of every group into a dense matrix."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="Triton CPU interpreter not enabled"
)

import gguf
import triton
import triton.language as tl
from gguf import GGMLQuantizationType as QT

from strata.engine.core.quant import gemv_planes as gp
from strata.engine.core.quant.lookup import lookup_table
from tests.helpers.quant_blocks import random_blocks


@triton.jit
def _scatter_planes(w_ptr, wh_ptr, table_ptr, out_ptr, num_groups, ROW_BYTES: tl.constexpr,
                    K: tl.constexpr, QTYPE: tl.constexpr, LANES: tl.constexpr,
                    ROWS: tl.constexpr, GROUPS: tl.constexpr):
    rows = tl.arange(0, ROWS)
    row_off = (rows.to(tl.int64) * ROW_BYTES)[:, None, None]
    group = tl.arange(0, GROUPS)[None, :, None]
    lane = tl.arange(0, LANES)[None, None, :]
    ok = (group < num_groups) & (rows[:, None, None] >= 0)
    w0, cols0, w1, cols1 = gp.planes_lut(w_ptr, wh_ptr, table_ptr, row_off, group, lane, ok,
                                         QTYPE)
    out_rows = out_ptr + rows[:, None, None] * K
    tl.store(out_rows + cols0, w0, mask=ok)
    tl.store(out_rows + cols1, w1, mask=ok)


@pytest.mark.parametrize("qtype", [QT.IQ2_XXS, QT.Q4_K, QT.Q2_K, QT.Q8_0, QT.MXFP4],
                         ids=lambda t: t.name)
def test_planes_lut_equals_gguf_py_bit_for_bit(qtype: QT) -> None:
    rows, cols = 8, 512
    raw = random_blocks(qtype, rows, cols, seed=3)
    expected = gguf.quants.dequantize(raw, qtype).astype(np.float32)
    lanes = {**gp.PLANE_LANES, **gp.LUT_PLANE_LANES}[int(qtype)]
    num_groups = cols // (2 * lanes)
    blocks = torch.from_numpy(raw)
    out = torch.full((rows, cols), float("nan"))
    # No contraction: d * q - m rounds twice, as numpy does.
    _scatter_planes[(1,)](blocks, blocks.view(torch.float16), lookup_table(blocks.device), out,
                          num_groups, ROW_BYTES=raw.shape[1], K=cols, QTYPE=int(qtype),
                          LANES=lanes, ROWS=rows, GROUPS=triton.next_power_of_2(num_groups),
                          enable_fp_fusion=False)
    np.testing.assert_array_equal(out.numpy(), expected)
