"""The quantized kernels (strata.engine.core.quant) against gguf-py, through Triton's CPU
interpreter: dequantization bit for bit in float32 for every type with a kernel, on random
blocks and on the default model's own blocks; products against torch on the dequantized
matrix for 1, 2, 4, 16 tokens and a prefill. tests/gpu/test_quant_cuda.py repeats them on
the GPU in bf16 with compiled kernels.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

# Must precede the first Triton import: triton.jit picks the interpreter at decoration time.
# Not on a CUDA machine, where the GPU tests in the same session need compiled kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="Triton CPU interpreter not enabled"
)

import gguf
from gguf import GGMLQuantizationType as QT

from strata.engine.core.loader.quant_plan import KERNEL_QUANT_TYPES
from strata.engine.core.quant import dequant, kernels
from strata.engine.core.quant.weight import (
    QuantizedEmbedding,
    QuantizedWeight,
    qlinear,
)
from tests.helpers.quant_blocks import gguf_quantized, random_blocks

DEFAULT_MODEL = Path.home() / ".local/share/strata/models/SmolLM2-135M-Instruct.Q4_1.gguf"
ALL_TYPES = [QT[name] for name in KERNEL_QUANT_TYPES]


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_dequantize_equals_gguf_py_on_random_blocks(qtype: QT) -> None:
    """Random bytes reach every nibble, high bit, scale and sign path; the fp16 fields are
    random finite values of both signs."""
    raw = random_blocks(qtype, rows=6, cols=1024, seed=int(qtype))
    expected = gguf.quants.dequantize(raw, qtype)
    blocks = torch.from_numpy(raw)
    # The planes types take dequant.py's planes kernel, the others the per-value decode.
    assert dequant.kernel_for(qtype, blocks) == kernels.decode_kernel(qtype)
    got = kernels.dequantize(blocks, qtype, 1024, torch.float32)
    np.testing.assert_array_equal(got.numpy(), expected)


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0, QT.MXFP4],
                         ids=lambda t: t.name)
def test_dequantize_equals_gguf_py_on_quantized_values(qtype: QT) -> None:
    """Blocks gguf-py itself quantized (zero rows, tiny and large scales included)."""
    raw = gguf_quantized(qtype, rows=5, cols=256, seed=3)
    expected = gguf.quants.dequantize(raw, qtype)
    got = kernels.dequantize(torch.from_numpy(raw), qtype, 256, torch.float32)
    np.testing.assert_array_equal(got.numpy(), expected)


def test_mxfp4_every_exponent_and_code_equals_gguf_py() -> None:
    """All 256 E8M0 exponents (0 and 1: ggml's subnormal halves; the largest overflow to
    inf in float32, as in gguf-py) times all 16 E2M1 codes, bit for bit."""
    codes = np.arange(32, dtype=np.uint8) % 16
    packed = codes[:16] | (codes[16:] << 4)  # value j: low nibble of byte j, j + 16: high
    raw = np.zeros((256, 2, 17), dtype=np.uint8)  # 256 rows of two blocks
    raw[:, :, 0] = np.arange(256, dtype=np.uint8)[:, None]
    raw[:, :, 1:] = packed
    raw = raw.reshape(256, 34)
    with np.errstate(over="ignore"):
        expected = gguf.quants.dequantize(raw, QT.MXFP4)
        got = kernels.dequantize(torch.from_numpy(raw), QT.MXFP4, 64, torch.float32)
    np.testing.assert_array_equal(got.numpy(), expected)
    assert got[127, 1].item() == 0.5 and got[127, 15].item() == -6.0  # code 15: -6 * 2**0


@pytest.mark.skipif(not DEFAULT_MODEL.is_file(), reason="default model not downloaded")
@pytest.mark.parametrize("tensor_name", ["blk.0.attn_q.weight", "blk.29.ffn_down.weight",
                                         "token_embd.weight"])
def test_dequantize_equals_gguf_py_on_the_default_models_blocks(tensor_name: str) -> None:
    reader = gguf.GGUFReader(str(DEFAULT_MODEL))
    tensor = next(t for t in reader.tensors if t.name == tensor_name)
    assert tensor.tensor_type in (QT.Q4_1, QT.Q8_0)
    raw = np.array(tensor.data[:48])  # 48 rows: enough, and fast to interpret
    cols = int(tensor.shape[0])
    assert dequant.kernel_for(tensor.tensor_type, torch.from_numpy(raw)) == "planes"
    expected = gguf.quants.dequantize(raw, tensor.tensor_type)
    got = kernels.dequantize(torch.from_numpy(raw), tensor.tensor_type, cols, torch.float32)
    np.testing.assert_array_equal(got.numpy(), expected)


def _weight(qtype: QT, rows: int, cols: int, seed: int) -> tuple[QuantizedWeight, torch.Tensor]:
    raw = random_blocks(qtype, rows, cols, seed, scale=0.02)
    dense = torch.from_numpy(gguf.quants.dequantize(raw, qtype))
    return QuantizedWeight(qtype, (rows, cols), torch.from_numpy(raw), torch.float32), dense


# Float32 sums of 512 products: rounding grows with the largest term, so the absolute
# tolerance is a fraction of the output's scale.
RTOL, ATOL = 1e-4, 1e-4
ATOL_OF_SCALE = 1e-6


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("num_tokens", [1, 2, 4, 16, 40])
def test_qlinear_matches_torch_on_the_dequantized_weight(qtype: QT, num_tokens: int) -> None:
    """1..16 tokens take the fused kernel, 40 the dequantize-then-matmul prefill path."""
    weight, dense = _weight(qtype, rows=24, cols=512, seed=num_tokens)
    gen = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, 512, generator=gen)
    bias = torch.randn(24, generator=gen)
    # The reference in float64: torch's own float32 product rounds as much as the kernel
    # (4e-4 on outputs of up to 550 on one CPU), so a float32 reference failed by machine.
    expected = torch.nn.functional.linear(x.double(), dense.double(), bias.double())
    atol = ATOL_OF_SCALE * expected.abs().max().item()
    torch.testing.assert_close(qlinear(x, weight, bias).double(), expected, rtol=RTOL, atol=atol)
    torch.testing.assert_close(qlinear(x, weight).double(), expected - bias.double(), rtol=RTOL,
                               atol=atol)


PLANES_TYPES = [t for t in ALL_TYPES if int(t) in kernels.gp.ALL_PLANE_LANES]


@pytest.mark.parametrize("qtype", PLANES_TYPES, ids=lambda t: t.name)
def test_the_planes_kernel_covers_a_partial_last_tile_and_row_tile(qtype: QT) -> None:
    """K = 3 super-blocks (the last K tile of the planes kernel half full) and 70 rows (the
    last row tile partial), one token and three. Float32 sums in another order: within
    1e-5 of the output's scale (Q6_K's outputs reach tens)."""
    weight, dense = _weight(qtype, rows=70, cols=768, seed=5)
    x = torch.randn(3, 768, generator=torch.Generator().manual_seed(5))
    for num_tokens in (1, 3):
        expected = x[:num_tokens] @ dense.T
        error = (qlinear(x[:num_tokens], weight) - expected).abs().max().item()
        assert error <= 1e-5 * expected.abs().max().item(), (num_tokens, error)


def test_qlinear_reads_a_row_strided_input() -> None:
    """Fused q/k/v outputs are column slices: a strided x must multiply like a copy."""
    wide = torch.randn(3, 512)
    x = wide[:, 128:384]  # row stride 512
    for qtype in (QT.Q8_0, QT.Q4_1):
        assert kernels.decode_kernel(qtype) == "planes"
        weight, dense = _weight(qtype, rows=8, cols=256, seed=0)
        torch.testing.assert_close(qlinear(x, weight), x @ dense.T, rtol=RTOL, atol=ATOL)


def test_quantized_embedding_dequantizes_the_rows_it_reads() -> None:
    weight, dense = _weight(QT.Q4_1, rows=40, cols=256, seed=1)
    ids = torch.tensor([[3, 39], [0, 3]])
    got = QuantizedEmbedding(weight)(ids)
    assert got.shape == (2, 2, 256)
    torch.testing.assert_close(got, dense[ids], rtol=0, atol=0)


def test_quantized_weight_refuses_blocks_of_the_wrong_size() -> None:
    raw = torch.zeros(4, 33, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"Q8_0 blocks for a \[4, 32\] matrix must be uint8 "
                                         r"\(4, 34\)"):
        QuantizedWeight(QT.Q8_0, (4, 32), raw, torch.float32)


def test_a_prefill_dequantizes_a_large_matrix_in_pieces_of_rows(monkeypatch) -> None:
    """Past SCRATCH_PIECE_BYTES the weight goes in pieces of whole 256-row runs, each GEMM
    written into its columns: the same product, and the scratch holds one piece."""
    from strata.engine.core.quant import weight as weight_module

    weight, dense = _weight(QT.Q4_K, rows=600, cols=256, seed=2)
    monkeypatch.setattr(weight_module, "SCRATCH_PIECE_BYTES", 300 * 256 * 4)
    assert weight_module.row_pieces(weight) == [(0, 256), (256, 512), (512, 600)]
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(40, 256, generator=gen)
    bias = torch.randn(600, generator=gen)
    expected = torch.nn.functional.linear(x.double(), dense.double(), bias.double())
    atol = ATOL_OF_SCALE * expected.abs().max().item()
    torch.testing.assert_close(qlinear(x, weight, bias).double(), expected, rtol=RTOL, atol=atol)
