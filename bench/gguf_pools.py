"""Pools of random tensor bytes for random GGUF files: one pool per GGML type, repeated.

Drawing every value of an 18 GB file took minutes and timing does not depend on the values, so
each type gets one pool of bytes (whole blocks) that every tensor of that type repeats
cyclically. Quantized pools are random valid blocks (tests/helpers/quant_blocks.py: random
bytes with finite fp16 scale fields; every I-quant grid index of a random byte is in range),
with the scales chosen so the dequantized values have the float pools' std, 0.02.
"""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, for tests.helpers
from tests.helpers.quant_blocks import random_blocks

WEIGHT_STD = 0.02
POOL_BYTES = 1 << 24  # 16 MiB: repeats change no timing (caches key on addresses)
_PROBE_BLOCKS = 256  # blocks dequantized (gguf-py) to measure a scale's std


def _float_pool(qtype: QT, seed: int) -> np.ndarray:
    values = np.random.default_rng(seed).standard_normal(POOL_BYTES // 2, dtype=np.float32)
    values *= WEIGHT_STD
    if qtype == QT.F16:
        return values.astype(np.float16).view(np.uint8)
    # bf16: the top half of each float32 (truncation: the values only need the right scale).
    return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)


def weight_scale(qtype: QT, seed: int) -> float:
    """The fp16-field scale at which random_blocks of `qtype` dequantize to std WEIGHT_STD."""
    block_size = gguf.GGML_QUANT_SIZES[qtype][0]
    probe = random_blocks(qtype, _PROBE_BLOCKS, block_size, seed, scale=1.0)
    std = float(gguf.quants.dequantize(probe, qtype).std())
    return WEIGHT_STD / std if std > 0 else WEIGHT_STD


def _block_pool(qtype: QT, seed: int) -> np.ndarray:
    block_size, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    num_blocks = POOL_BYTES // block_bytes
    return random_blocks(qtype, num_blocks, block_size, seed,
                         scale=weight_scale(qtype, seed)).reshape(-1)


def byte_pool(qtype: QT, seed: int = 0) -> np.ndarray:
    """uint8 bytes of whole values/blocks of `qtype` (F16, BF16 or a quantized type)."""
    if qtype in (QT.F16, QT.BF16):
        return _float_pool(qtype, seed)
    if qtype == QT.F32:
        raise ValueError("F32 tensors are written from values, not a byte pool")
    return _block_pool(qtype, seed)


def row_bytes(qtype: QT, cols: int) -> int:
    """Bytes of one row of `cols` values of `qtype`."""
    block_size, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    if cols % block_size:
        raise ValueError(f"a row of {cols} values is not whole {qtype.name} blocks of "
                         f"{block_size}: pick dimensions that are multiples of {block_size}")
    return cols // block_size * block_bytes


class RepeatedBytes:
    """A tensor's bytes as the pool repeated, written without being built: what
    GGUFWriter.write_tensor_data needs of an array (nbytes, tofile). The pool holds whole
    blocks, so every block of the tensor is one of the pool's."""

    def __init__(self, pool: np.ndarray, qtype: QT, shape: tuple[int, ...]):
        self.pool = pool
        self.nbytes = int(np.prod(shape[:-1], dtype=np.int64)) * row_bytes(qtype, shape[-1])

    def tofile(self, out) -> None:
        view = memoryview(self.pool)
        for start in range(0, self.nbytes, len(view)):
            out.write(view[: min(len(view), self.nbytes - start)])
