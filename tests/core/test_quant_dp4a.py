"""The int8 dot-product GEMV for Q4_K, Q5_K, Q6_K, Q8_0, Q4_0 and IQ2_XXS (quant/gemv_dp4a.py,
dp4a_dots.py) through Triton's CPU interpreter, dp4a and the funnel shift emulated: x's int8
rounding against numpy, and the product equal to the dequantized weight times the int8-rounded
x (the same integer sums, float32 scales), and within the rounding's reach of the exact
product. Random blocks cover every scale's sign and every 6-bit value; Q6_K's 210-byte, Q8_0's
34-byte and Q4_0's 18-byte blocks sit at 0 and 2 mod 4, in rows that start at both.
tests/gpu/test_quant_cuda.py runs the compiled kernel (real dp4a) against the same references.
"""

from __future__ import annotations

import os
import re

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
from strata.engine.core.quant.dp4a_dots import DP4A_TYPE_NAMES, row_alignment
from strata.engine.core.quant.weight import QuantizedWeight, qlinear
from tests.helpers.quant_blocks import random_blocks, random_pair


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


# (type, rows, columns): partial row tiles of the interpreter's 64 x 512, and K steps whose
# last groups lie past the row. Q6_K rows of 3 blocks (630 bytes) and Q8_0 rows of 17 (578)
# start at 0 and 2 mod 4 in turn, so every block alignment meets both row alignments.
# IQ2_XXS rows of 3 blocks (198 bytes) start at 0 and 2 mod 4 likewise, and its 66-byte
# blocks alternate within a row; Q4_0 rows of 17 blocks (306 bytes) and Q5_0's (374) too.
# Q4_1's 20- and Q5_1's 24-byte blocks keep a row's alignment: rows at 2 mod 4 below.
SHAPES = [(QT.Q4_K, 5, 768), (QT.Q4_K, 70, 768), (QT.Q5_K, 5, 768), (QT.Q5_K, 70, 768),
          (QT.Q6_K, 5, 768), (QT.Q6_K, 70, 768),
          (QT.Q6_K, 3, 1024), (QT.Q8_0, 5, 544), (QT.Q8_0, 70, 544), (QT.Q8_0, 4, 1024),
          (QT.IQ2_XXS, 5, 768), (QT.IQ2_XXS, 70, 768), (QT.IQ2_XXS, 3, 1024),
          (QT.Q4_0, 5, 544), (QT.Q4_0, 70, 544), (QT.Q4_0, 4, 1024),
          (QT.Q5_0, 5, 544), (QT.Q5_0, 70, 544), (QT.Q5_0, 4, 1024),
          (QT.Q4_1, 5, 544), (QT.Q5_1, 5, 544)]


@pytest.mark.parametrize(("qtype", "rows", "cols"), SHAPES,
                         ids=[f"{t.name}-{r}x{c}" for t, r, c in SHAPES])
def test_product_equals_the_dequantized_weight_times_int8_x(qtype: QT, rows: int,
                                                           cols: int) -> None:
    raw = random_blocks(qtype, rows, cols, seed=rows + cols, scale=0.02)
    dense = torch.from_numpy(gguf.quants.dequantize(raw, qtype))
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(1, cols, generator=gen).half()
    bias = torch.randn(rows, generator=gen).half() if rows % 2 else None
    weight = QuantizedWeight(qtype, (rows, cols), torch.from_numpy(raw), torch.float16)
    assert gemv_dp4a.is_enabled(x, qtype, weight.raw)
    got = qlinear(x, weight, bias).float()
    offset = bias.float() if bias is not None else 0.0
    expected = _int8_rounded(x) @ dense.T + offset
    scale = expected.abs().max().item()
    assert (got - expected).abs().max().item() <= 2e-3 * scale  # fp16 output rounding
    exact = x.float() @ dense.T + offset
    assert (got - exact).abs().max().item() <= 3e-2 * scale  # what int8 x costs


def test_q6k_extreme_values_and_scales_come_out_exactly() -> None:
    """Every 6-bit value at 0 and 63 (q - 32 = -32 and 31) under scales -128 and 127: the
    unsigned bytes and the dp4a of x by bytes of -32 give the same integers as signed values."""
    raw = random_blocks(QT.Q6_K, 4, 512, seed=5, scale=0.02).reshape(4, 2, 210)
    raw[0, :, :192] = 0xFF  # every q = 63
    raw[1, :, :192] = 0x00  # every q = 0
    raw[:2, :, 192:208] = np.array([0x80, 0x7F] * 8, dtype=np.uint8)  # scales -128, 127
    raw = raw.reshape(4, -1)
    dense = torch.from_numpy(gguf.quants.dequantize(raw, QT.Q6_K))
    x = torch.randn(1, 512, generator=torch.Generator().manual_seed(9)).half()
    weight = QuantizedWeight(QT.Q6_K, (4, 512), torch.from_numpy(raw), torch.float16)
    got = qlinear(x, weight).float()
    expected = _int8_rounded(x) @ dense.T
    assert (got - expected).abs().max().item() <= 2e-3 * expected.abs().max().item()


def test_float32_misaligned_and_other_types_keep_the_planes_kernel() -> None:
    x = torch.randn(1, 256)
    assert not gemv_dp4a.is_enabled(x, QT.Q4_K)
    assert not gemv_dp4a.is_enabled(x.half(), QT.Q2_K)
    assert not gemv_dp4a.is_enabled(torch.randn(2, 256).half(), QT.Q6_K)
    assert kernels.decode_kernel(QT.Q6_K) == "planes"
    # Blocks at 2 mod 4 (a fused view's second part can start there): planes, same product.
    raw = random_blocks(QT.Q8_0, 3, 32 * 17, seed=1, scale=0.02)  # rows of 578 bytes
    blocks = torch.from_numpy(raw)[1:]
    assert blocks.data_ptr() % 4 == 2
    x = torch.randn(1, 32 * 17, generator=torch.Generator().manual_seed(2)).half()
    assert not gemv_dp4a.is_enabled(x, QT.Q8_0, blocks)
    weight = QuantizedWeight(QT.Q8_0, (2, 32 * 17), blocks, torch.float16)
    dense = torch.from_numpy(gguf.quants.dequantize(raw[1:], QT.Q8_0))
    expected = x.float() @ dense.T
    got = qlinear(x, weight).float()
    assert (got - expected).abs().max().item() <= 2e-3 * expected.abs().max().item()


def test_bad_input_is_refused_with_a_clear_error() -> None:
    raw = torch.zeros(4, 144, dtype=torch.uint8)
    # The message names every type the kernel takes, from DP4A_TYPES itself.
    with pytest.raises(ValueError, match=re.escape(f"one token and {DP4A_TYPE_NAMES}, got")):
        gemv_dp4a.matmul(torch.zeros(2, 256).half(), raw, QT.Q4_K, 4)
    with pytest.raises(ValueError, match="multiple of 32"):
        gemv_dp4a.quantize_x(torch.zeros(1, 48).half())


# (part a, rows a, part b, rows b, columns): Q4_K_M's q+k then a Q6_K v; an IQ2_XXS mix's
# q+k then a Q4_K v (38 rows of 198 bytes: part b 4-aligned, as Q4_K must be); three Q6_K
# rows of 630 bytes putting a Q8_0 part b at 2 mod 4; Gemma 3's Q4_0 q+k then v, part b
# at 2 mod 4 after seven rows of 306 bytes; a Q5_1 part b at 2 mod 4 after seven Q5_0 rows
# of 374. Rows past a tile's end in both parts.
PAIRS = [(QT.Q4_K, 70, QT.Q6_K, 5, 768), (QT.IQ2_XXS, 38, QT.Q4_K, 9, 768),
         (QT.Q6_K, 3, QT.Q8_0, 6, 768), (QT.Q4_0, 7, QT.Q4_0, 3, 544),
         (QT.Q5_0, 7, QT.Q5_1, 3, 544)]


@pytest.mark.parametrize(("type_a", "rows_a", "type_b", "rows_b", "cols"), PAIRS,
                         ids=[f"{a.name}-{b.name}" for a, _, b, _, _ in PAIRS])
def test_a_pair_of_types_in_one_launch_equals_their_separate_products(
        type_a: QT, rows_a: int, type_b: QT, rows_b: int, cols: int) -> None:
    """matmul_pair over two runs of rows of two types back to back: every row as matmul
    gives it for its own part (the same int8 x, the same sums), bias included."""
    raw_a, raw_b, pair = random_pair(type_a, rows_a, type_b, rows_b, cols, seed=1, scale=0.02)
    x = torch.randn(1, cols, generator=torch.Generator().manual_seed(3)).half()
    bias = torch.randn(rows_a + rows_b, generator=torch.Generator().manual_seed(4)).half()
    assert gemv_dp4a.is_pair_enabled(x)
    got = gemv_dp4a.matmul_pair(x, pair, bias)
    expected = torch.cat([gemv_dp4a.matmul(x, raw_a, type_a, rows_a, bias[:rows_a]),
                          gemv_dp4a.matmul(x, raw_b, type_b, rows_b, bias[rows_a:])], dim=1)
    assert got.shape == (1, rows_a + rows_b)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_a_pair_is_refused_where_a_part_cannot_be_read() -> None:
    q4k_rows, q6k_rows = 144 * 3, 210 * 3  # bytes of a 768-value row
    assert not gemv_dp4a.pair_supported((int(QT.Q6_K), int(QT.Q4_K)), (q6k_rows, q4k_rows),
                                        768, 0, 1)  # Q4_K at 630: not 4-aligned
    assert gemv_dp4a.pair_supported((int(QT.Q6_K), int(QT.Q4_K)), (q6k_rows, q4k_rows),
                                    768, 0, 2)
    assert not gemv_dp4a.pair_supported((int(QT.Q4_K), int(QT.Q2_K)), (q4k_rows, 84 * 3),
                                        768, 0, 1)  # Q2_K has no dp4a decoding
    assert not gemv_dp4a.pair_supported((int(QT.Q4_K), int(QT.Q6_K)), (q4k_rows, q6k_rows),
                                        768, 2, 1)  # the base itself at 2 mod 4
    with pytest.raises(ValueError, match="one token of 768"):
        pair = gemv_dp4a.QuantizedPair(torch.zeros(q4k_rows + q6k_rows, dtype=torch.uint8),
                                       (int(QT.Q4_K), int(QT.Q6_K)), (1, 1),
                                       (q4k_rows, q6k_rows), 768)
        gemv_dp4a.matmul_pair(torch.zeros(2, 768).half(), pair)


def test_tuned_tiles_are_read_and_pinned_as_the_autotuner_keeps_them() -> None:
    """quant_bench records which tile each product ran and can pin another run's, so two
    trees are compared on the same tiles. Interpreted there is no autotuner; compiled (a
    process without TRITON_INTERPRET, the picks the autotuner's own cache) a pin is read
    back as pinned, and a tile that is not a candidate is refused before anything changes."""
    import ast
    import subprocess
    import sys

    assert gemv_dp4a.tuned_tiles() == {}  # this module runs interpreted
    with pytest.raises(ValueError, match="interpreter"):
        gemv_dp4a.pin_tiles({})
    script = """
import triton
from strata.engine.core.quant import gemv_dp4a
tile = str(gemv_dp4a._tuned[12].configs[-1])
key = repr((28672, 64, 12, 'torch.int32'))
try:
    gemv_dp4a.pin_tiles({"_dp4a_kernel type 12": {key: tile},
                         "_dp4a_kernel type 14": {key: "BLOCK_ROWS: 999"}})
except ValueError as exc:
    print(repr(str(exc)))
print(gemv_dp4a.tuned_tiles())
print(gemv_dp4a.pin_tiles({"_dp4a_kernel type 12": {key: tile}}))
print(gemv_dp4a.tuned_tiles() == {"_dp4a_kernel type 12": {key: tile}})
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, check=True)
    refusal, before, count, same = done.stdout.splitlines()
    assert "not among this tree's candidates" in ast.literal_eval(refusal)
    assert ast.literal_eval(before) == {}  # the refused call pinned nothing
    assert (count, same) == ("1", "True")


def test_only_small_pdl_products_load_weights_before_their_wait(monkeypatch) -> None:
    """prewait: a PDL secondary up to 16 MiB of weight loads its first step before the wait
    (q/k/v, o); larger products and plain launches wait first; the bound is an env switch."""
    mib = 2**20
    assert gemv_dp4a.prewait(True, 16 * mib) and gemv_dp4a.prewait(True, 1)
    assert not gemv_dp4a.prewait(True, 16 * mib + 1)
    assert not gemv_dp4a.prewait(False, 1)
    monkeypatch.setenv("STRATA_DP4A_PREWAIT_MIB", "0")
    assert not gemv_dp4a.prewait(True, 1)
    monkeypatch.setenv("STRATA_DP4A_PREWAIT_MIB", "64")
    assert gemv_dp4a.prewait(True, 64 * mib)


def test_funnel_and_byte_perm_twins_follow_the_ptx_manual() -> None:
    """The interpreter's funnel (shf.r.wrap at shifts 0, 8, 16, 24: MXFP4's codes lie at any
    byte) and byte_perm (prmt, sign replication included: MXFP4's lookups rely on it) equal
    numpy's reading of the PTX manual; tests/gpu/test_quant_cuda.py runs the instructions."""
    from tests.helpers.dp4a_twins import check_twins

    check_twins("cpu", emulate=True, count=1000, seed=0)


# Q4_0, Q4_1, Q5_0, Q5_1 (rows of 17 blocks) in rows of 2 mod 4 bytes (Q4_1's and Q5_1's
# padded by 2), so rows start at 0 and 2 mod 4 in turn whatever the block size (a row's
# blocks keep its alignment in Q4_1 and Q5_1, whose blocks are multiples of 4 bytes).
NIBBLE_TYPES = [QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1]


@pytest.mark.parametrize("qtype", NIBBLE_TYPES, ids=lambda t: t.name)
def test_nibble_types_read_rows_at_both_even_alignments(qtype: QT) -> None:
    """Every row base the kernel accepts (row_alignment 2: 0 and 2 mod 4): the dequantized
    weight times x as quantize_x rounds it. Random bytes give every fifth bit (qh) and
    every nibble, and mins of both signs."""
    rows, cols = 7, 544
    raw = random_blocks(qtype, rows, cols, seed=int(qtype), scale=0.02)
    padded = np.zeros((rows, raw.shape[1] + (2 - raw.shape[1]) % 4), dtype=np.uint8)
    padded[:, :raw.shape[1]] = raw
    blocks = torch.from_numpy(padded)
    assert row_alignment(qtype) == 2 and blocks.shape[1] % 4 == 2
    dense = torch.from_numpy(gguf.quants.dequantize(raw, qtype))
    x = torch.randn(1, cols, generator=torch.Generator().manual_seed(5)).half()
    assert gemv_dp4a.is_enabled(x, qtype, blocks)
    got = gemv_dp4a.matmul(x, blocks, qtype, rows).float()
    expected = _int8_rounded(x) @ dense.T
    scale = expected.abs().max().item()
    assert (got - expected).abs().max().item() <= 2e-3 * scale


# MXFP4 rows of 17 blocks (289 bytes) start at every byte mod 4, as do its blocks; rows of
# 32 (544 bytes) go through qlinear (the dense path takes even rows), past a tile's end.
MXFP4_SHAPES = [(5, 544), (70, 544), (3, 1024)]


@pytest.mark.parametrize(("rows", "cols"), MXFP4_SHAPES,
                         ids=[f"{r}x{c}" for r, c in MXFP4_SHAPES])
def test_mxfp4_product_equals_the_dequantized_weight_times_int8_x(rows: int, cols: int) -> None:
    """Every E2M1 code (random bytes: -0 among them) looked up by prmt, the exponent's half
    scale per block: the dequantized weight times x as quantize_x rounds it."""
    raw = random_blocks(QT.MXFP4, rows, cols, seed=rows + cols, scale=0.02)
    dense = torch.from_numpy(gguf.quants.dequantize(raw, QT.MXFP4))
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(1, cols, generator=gen).half()
    blocks = torch.from_numpy(raw)
    assert gemv_dp4a.is_enabled(x, QT.MXFP4, blocks)
    if raw.shape[1] % 2:  # odd rows: gemv_dp4a.matmul itself
        got = gemv_dp4a.matmul(x, blocks, QT.MXFP4, rows).float()
    else:
        got = qlinear(x, QuantizedWeight(QT.MXFP4, (rows, cols), blocks, torch.float16)).float()
    expected = _int8_rounded(x) @ dense.T
    scale = expected.abs().max().item()
    assert (got - expected).abs().max().item() <= 2e-3 * scale
