"""GGUF expert blocks in the forms torch's CPU kernels take (issue 54's CPU-computed miss).

Q4_K is exactly an asymmetric int4 in groups of 32: sub-block j of a 256-value super-block
dequantizes to d * sc_j * q - dmin * m_j with q in 0..15. torch's
_weight_int4pack_mm_for_cpu reads w = (q - 8) * scale + zero per group (torch's own test,
_group_quantize_tensor in test/test_linalg.py, and torchao's get_groupwise_affine_qparams
write zero = min + 8 * scale), so scale = d * sc_j and zero = 8 * scale - dmin * m_j.
Q6_K (6-bit, 16-value sub-blocks) and Q8_0 have no int4 form without loss; they are
requantized to int8 per output row for _weight_int8pack_mm (lossy: the row's largest value
sets the step).
"""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QT

INT4_GROUP = 32  # a Q4_K sub-block
INNER_K_TILES = 8  # ignored by the CPU packer's layout (same output for 1..8 here)


@dataclasses.dataclass(frozen=True)
class Int4Groups:
    """A [rows, cols] matrix as int4 codes (0..15) with a float32 scale and zero per group of
    INT4_GROUP columns: w = (q - 8) * scale + zero."""

    codes: torch.Tensor  # int32 [rows, cols]
    scales: torch.Tensor  # float32 [rows, cols / 32]
    zeros: torch.Tensor  # float32 [rows, cols / 32]

    def dequantize(self) -> torch.Tensor:
        """float32 [rows, cols] by the torch kernel's formula (the convention under test)."""
        scales = self.scales.repeat_interleave(INT4_GROUP, dim=1)
        zeros = self.zeros.repeat_interleave(INT4_GROUP, dim=1)
        return (self.codes.float() - 8) * scales + zeros

    def packed(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(uint8 [rows, cols / 2] packed codes, scales_and_zeros [cols / 32, rows, 2] in
        `dtype`): the two operands of _weight_int4pack_mm_for_cpu (x must be `dtype` too)."""
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(self.codes, INNER_K_TILES)
        scales_and_zeros = torch.stack((self.scales, self.zeros), dim=-1).transpose(0, 1)
        return packed, scales_and_zeros.to(dtype).contiguous()


def q4k_to_int4(blocks: np.ndarray, rows: int, cols: int) -> Int4Groups:
    """uint8 [rows, row_bytes] of Q4_K blocks -> the same values as Int4Groups (exact up to
    float32 rounding of scale and zero)."""
    raw = torch.from_numpy(np.ascontiguousarray(blocks)).view(rows, cols // 256, 144)
    d = raw[..., 0:2].contiguous().view(torch.float16).float()  # [rows, nb, 1]
    dmin = raw[..., 2:4].contiguous().view(torch.float16).float()
    packed_scales = raw[..., 4:16].int().view(rows, -1, 3, 4)
    lo, hi, mixed = packed_scales.unbind(dim=2)  # gguf-py Q4_K.get_scale_min's layout
    sc = torch.cat((lo & 63, (mixed & 15) | ((lo >> 2) & 48)), dim=-1)  # [rows, nb, 8]
    mins = torch.cat((hi & 63, (mixed >> 4) | ((hi >> 2) & 48)), dim=-1)
    qs = raw[..., 16:].int().view(rows, -1, 4, 1, 32)  # 64 values a chunk of 32 bytes
    codes = torch.cat((qs & 15, qs >> 4), dim=3).reshape(rows, cols)  # low nibbles first
    scales = (d * sc).reshape(rows, -1)
    zeros = (8 * d * sc - dmin * mins).reshape(rows, -1)
    return Int4Groups(codes.contiguous(), scales, zeros)


def dequantized(blocks: np.ndarray, qtype: QT, rows: int, cols: int) -> torch.Tensor:
    """float32 [rows, cols]: gguf-py's reference dequantization."""
    return torch.from_numpy(gguf.quants.dequantize(blocks, qtype).reshape(rows, cols).copy())


def to_int8_rows(weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 [rows, cols] -> (int8 [rows, cols], float32 scale [rows]): symmetric per-row
    requantization, _weight_int8pack_mm's form."""
    scales = weights.abs().amax(dim=1).clamp(min=1e-30) / 127
    codes = torch.round(weights / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return codes, scales


def int4_bytes(rows: int, cols: int, scale_bytes: int = 2) -> int:
    """Host bytes of an int4-packed matrix: nibbles plus a scale and zero per group."""
    return rows * cols // 2 + 2 * scale_bytes * rows * cols // INT4_GROUP


def int8_bytes(rows: int, cols: int, scale_bytes: int = 2) -> int:
    """Host bytes of a per-row int8 matrix."""
    return rows * cols + scale_bytes * rows


def gguf_bytes(qtype: QT, rows: int, cols: int) -> int:
    """Bytes of the GGUF blocks of a [rows, cols] matrix."""
    block_size, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    return rows * cols // block_size * block_bytes
