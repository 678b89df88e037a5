"""The int8 dot-product GEMV for Q4_K (quant/gemv_dp4a.py) through Triton's CPU interpreter,
dp4a emulated: x's int8 rounding against numpy, and the product equal to the dequantized
weight times the int8-rounded x (the same integer sums, float32 scales), and within the
rounding's reach of the exact product. tests/gpu/test_quant_cuda.py runs the compiled
kernel (real dp4a) against the same references.
"""

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
from gguf import GGMLQuantizationType as QT

from strata.engine.core.quant import gemv_dp4a, kernels
from strata.engine.core.quant.weight import QuantizedWeight, qlinear
from tests.helpers.quant_blocks import random_blocks


def _int8_rounded(x: torch.Tensor) -> torch.Tensor:
    """x as quantize_x rounds it, in numpy: per 32 values q = round(x * 127 / max|x|) (ties
    away from zero), back to float as q * max|x| / 127."""
    v = x.float().numpy().reshape(x.shape[0], -1, 32)
    amax = np.abs(v).max(axis=2, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        scaled = np.where(amax > 0, v * (np.float32(127.0) / amax), 0).astype(np.float32)
    q = np.clip(np.trunc(scaled + np.where(scaled >= 0, 0.5, -0.5)), -127, 127)
    return torch.from_numpy((q * (amax / np.float32(127.0))).reshape(x.shape).astype(np.float32))


def test_quantize_x_rounds_each_32_to_int8_with_its_scale_and_sum() -> None:
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(0)).half()
    x[1, 32:64] = 0  # an all-zero group: scale 0, no division by zero
    q, d, s = gemv_dp4a.quantize_x(x)
    np.testing.assert_allclose((q.float().view(2, -1, 32) * d[:, :, None]).view(2, 256),
                               _int8_rounded(x), rtol=1e-6, atol=0)
    torch.testing.assert_close(s, (q.float().view(2, -1, 32).sum(2) * d), rtol=1e-6, atol=0)
    assert d[1, 1] == 0 and (q[1, 32:64] == 0).all()


@pytest.mark.parametrize("rows", [5, 70])
def test_q4k_product_equals_the_dequantized_weight_times_int8_x(rows: int) -> None:
    """Rows of 3 super-blocks (a K tile half full), row tiles partial; bias or none."""
    cols = 768
    raw = random_blocks(QT.Q4_K, rows, cols, seed=rows, scale=0.02)
    dense = torch.from_numpy(gguf.quants.dequantize(raw, QT.Q4_K))
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(1, cols, generator=gen).half()
    bias = torch.randn(rows, generator=gen).half()
    weight = QuantizedWeight(QT.Q4_K, (rows, cols), torch.from_numpy(raw), torch.float16)
    assert gemv_dp4a.is_enabled(x, QT.Q4_K)
    got = qlinear(x, weight, bias).float()
    expected = _int8_rounded(x) @ dense.T + bias.float()
    scale = expected.abs().max().item()
    assert (got - expected).abs().max().item() <= 2e-3 * scale  # fp16 output rounding
    exact = x.float() @ dense.T + bias.float()
    assert (got - exact).abs().max().item() <= 3e-2 * scale  # what int8 x costs


def test_float32_and_other_types_keep_the_planes_kernel() -> None:
    x = torch.randn(1, 256)
    assert not gemv_dp4a.is_enabled(x, QT.Q4_K)
    assert not gemv_dp4a.is_enabled(x.half(), QT.Q6_K)
    assert not gemv_dp4a.is_enabled(torch.randn(2, 256).half(), QT.Q4_K)
    assert kernels.decode_kernel(QT.Q4_K) == "planes"


def test_bad_input_is_refused_with_a_clear_error() -> None:
    raw = torch.zeros(4, 144, dtype=torch.uint8)
    with pytest.raises(ValueError, match="one token and Q4_K"):
        gemv_dp4a.matmul(torch.zeros(2, 256).half(), raw, QT.Q4_K, 4)
    with pytest.raises(ValueError, match="multiple of 32"):
        gemv_dp4a.quantize_x(torch.zeros(1, 48).half())
