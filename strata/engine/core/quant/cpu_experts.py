"""One MoE expert in the forms torch's CPU kernels take, and its FFN on the CPU (issue 54's
CPU-computed miss: an expert with no VRAM slot computed from the host copy instead of read
over PCIe).

Q4_K is exactly an asymmetric int4 in groups of 32: sub-block j of a 256-value super-block
dequantizes to d * sc_j * q - dmin * m_j with q in 0..15. torch's
_weight_int4pack_mm_for_cpu reads w = (q - 8) * scale + zero per group (torch's own test,
_group_quantize_tensor in test/test_linalg.py, and torchao's get_groupwise_affine_qparams
write zero = min + 8 * scale), so scale = d * sc_j and zero = 8 * scale - dmin * m_j: exact
up to the scale's and zero's rounding to the compute dtype (bf16: ~4e-3 of max |w|).
Every other GGML type is dequantized by gguf-py (the loader's reference) and requantized to
int8 per output row for _weight_int8pack_mm: lossy, each value within half a step of its
row's max / 127 (INT8_MAX_ERROR). Not by quant/dequant.py: that is a Triton kernel, which on
a GPU host would carry each block over PCIe (what this path avoids) and on the CPU only runs
interpreted. bf16 in place of int8 would hold twice the bytes (54 GiB for Qwen3-30B-A3B's
experts) and runs ~2.5x slower for one token (docs/benchmarks.md). Float experts are used
as they are (F.linear over views of the host copy).
Activations run in bf16 (torch's fast CPU path; float32 runs 25-30x slower) unless the
model computes in float32 (the CPU engine and its tests).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

INT4_GROUP = 32  # a Q4_K sub-block
INNER_K_TILES = 8  # ignored by the CPU packer's layout (same output for 1..8 here)
# int8 per-row requantization: |w - w'| <= max |row| / 127 / 2, relative to the row's max.
INT8_MAX_ERROR = 0.5 / 127
Q4_K = GGMLQuantizationType.Q4_K


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

    @staticmethod
    def cat(parts: list[Int4Groups]) -> Int4Groups:
        """Row blocks stacked into one matrix (gate over up: one kernel call for both)."""
        return Int4Groups(*(torch.cat([getattr(p, f) for p in parts])
                            for f in ("codes", "scales", "zeros")))


def q4k_to_int4(blocks: np.ndarray | torch.Tensor, rows: int, cols: int) -> Int4Groups:
    """uint8 [rows, row_bytes] of Q4_K blocks -> the same values as Int4Groups (exact up to
    float32 rounding of scale and zero)."""
    raw = torch.as_tensor(blocks).contiguous().view(rows, cols // 256, 144)
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


def dequantized(blocks: np.ndarray | torch.Tensor, qtype: GGMLQuantizationType, rows: int,
                cols: int) -> torch.Tensor:
    """float32 [rows, cols]: gguf-py's reference dequantization."""
    raw = np.asarray(blocks.numpy() if isinstance(blocks, torch.Tensor) else blocks)
    values = gguf_quants.dequantize(raw, qtype).reshape(rows, cols)
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))


def to_int8_rows(weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 [rows, cols] -> (int8 [rows, cols], float32 scale [rows]): symmetric per-row
    requantization, _weight_int8pack_mm's form."""
    scales = weights.abs().amax(dim=1).clamp(min=1e-30) / 127
    codes = torch.round(weights / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return codes, scales


def has_cpu_form(qtype: GGMLQuantizationType | None) -> bool:
    """Whether experts of this GGML type (None: float) have a CPU form here: Q4_K's own, or
    gguf-py's dequantization (F32, F16 and the types it has traits for)."""
    return (qtype is None or qtype in (Q4_K, GGMLQuantizationType.F32, GGMLQuantizationType.F16)
            or qtype in gguf_quants._type_traits)


def gguf_bytes(qtype: GGMLQuantizationType, rows: int, cols: int) -> int:
    """Bytes of the GGUF blocks of a [rows, cols] matrix."""
    block_size, block_bytes = GGML_QUANT_SIZES[qtype]
    return rows * cols // block_size * block_bytes


@dataclasses.dataclass(frozen=True)
class CpuMatrix:
    """One [rows, cols] weight as a torch CPU kernel reads it: "int4" (packed codes, scales
    and zeros), "int8" (codes, per-row scales) or "dense" (the weight itself, no copy)."""

    kind: str
    rows: int
    weight: torch.Tensor
    scales: torch.Tensor | None = None

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, cols] (the compute dtype) @ weight.T -> [T, rows]."""
        if self.kind == "int4":
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.weight, INT4_GROUP,
                                                              self.scales)
        if self.kind == "int8":
            return torch.ops.aten._weight_int8pack_mm(x, self.weight, self.scales)
        return F.linear(x, self.weight)

    @property
    def nbytes(self) -> int:
        """Host bytes this form holds of its own (a dense view of the host copy: none)."""
        if self.kind == "dense":
            return 0
        return self.weight.nbytes + (self.scales.nbytes if self.scales is not None else 0)


@dataclasses.dataclass(frozen=True)
class Projection:
    """A projection of one expert as the host copy holds it: GGUF blocks uint8
    [rows, row_bytes] with their type, or a float [rows, cols] tensor (qtype None)."""

    data: torch.Tensor
    qtype: GGMLQuantizationType | None
    rows: int
    cols: int


def cpu_matrix(parts: list[Projection], dtype: torch.dtype) -> CpuMatrix:
    """The row-stacked projections (gate over up, or down alone) in one CPU form: int4 when
    all are Q4_K, dense when all are float (a view when there is one part), else int8."""
    rows = sum(p.rows for p in parts)
    if all(p.qtype == Q4_K for p in parts):
        groups = Int4Groups.cat([q4k_to_int4(p.data, p.rows, p.cols) for p in parts])
        packed, scales_and_zeros = groups.packed(dtype)
        return CpuMatrix("int4", rows, packed, scales_and_zeros)
    if all(p.qtype is None for p in parts):
        weights = [p.data if p.data.dtype == dtype else p.data.to(dtype) for p in parts]
        return CpuMatrix("dense", rows, weights[0] if len(weights) == 1 else torch.cat(weights))
    values = torch.cat([p.data.float() if p.qtype is None
                        else dequantized(p.data, p.qtype, p.rows, p.cols) for p in parts])
    codes, scales = to_int8_rows(values)
    return CpuMatrix("int8", rows, codes, scales.to(dtype))


@dataclasses.dataclass(frozen=True)
class CpuExpert:
    """One expert's gate and up (one matrix, [2I, H]) and down ([H, I]) in CPU forms."""

    gate_up: CpuMatrix
    down: CpuMatrix
    intermediate: int

    @property
    def nbytes(self) -> int:
        return self.gate_up.nbytes + self.down.nbytes


def cpu_expert(gate: Projection, up: Projection, down: Projection,
               dtype: torch.dtype) -> CpuExpert:
    """Convert one expert's projections (from the host copy) to its CPU forms."""
    return CpuExpert(cpu_matrix([gate, up], dtype), cpu_matrix([down], dtype), gate.rows)


@dataclasses.dataclass(frozen=True)
class HostEpilogue:
    """What an expert adds to plain SwiGLU (fast/expert_epilogue.Epilogue, GPT-OSS), with its
    biases on the host: gate/up [E, I] and down [E, H] float32, or None."""

    gate_bias: torch.Tensor | None
    up_bias: torch.Tensor | None
    down_bias: torch.Tensor | None
    limit: float | None
    alpha: float

    @staticmethod
    def of(epilogue) -> HostEpilogue | None:
        """The host form of an Epilogue (None stays None)."""
        if epilogue is None:
            return None

        def host(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.detach().float().cpu()

        return HostEpilogue(host(epilogue.gate_bias), host(epilogue.up_bias),
                            host(epilogue.down_bias), epilogue.limit, float(epilogue.alpha))


def expert_ffn(x: torch.Tensor, expert: CpuExpert, expert_id: int,
               epilogue: HostEpilogue | None = None) -> torch.Tensor:
    """One expert's FFN on the CPU: x [T, H] in the compute dtype -> float32 [T, H];
    SwiGLU, or the epilogue's biases and clamped SwiGLU (ExpertActivation's formula)."""
    gate, up = expert.gate_up.matmul(x).float().split(expert.intermediate, dim=-1)  # [T, I]
    if epilogue is None:
        act = F.silu(gate) * up
    else:
        if epilogue.gate_bias is not None:
            gate = gate + epilogue.gate_bias[expert_id]
            up = up + epilogue.up_bias[expert_id]  # type: ignore[index]
        if epilogue.limit is None:
            act = F.silu(gate) * up
        else:
            gate = gate.clamp(max=epilogue.limit)
            up = up.clamp(min=-epilogue.limit, max=epilogue.limit)
            act = gate * torch.sigmoid(gate * epilogue.alpha) * (up + 1)
    y = expert.down.matmul(act.to(x.dtype)).float()  # [T, H]
    if epilogue is not None and epilogue.down_bias is not None:
        y = y + epilogue.down_bias[expert_id]
    return y


def routed_ffn(x: torch.Tensor, experts: list[CpuExpert], expert_ids: list[int],
               weights: list[float], epilogue: HostEpilogue | None = None) -> torch.Tensor:
    """One token's given experts on the CPU: x [H] -> float32 [H] = sum_k w_k * FFN_k(x)."""
    out = torch.zeros(x.shape[-1], dtype=torch.float32)
    xs = x.reshape(1, -1)
    for expert, expert_id, weight in zip(experts, expert_ids, weights, strict=True):
        out += weight * expert_ffn(xs, expert, expert_id, epilogue)[0]
    return out


def compute_dtype(model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the CPU experts compute in: float32 for a float32 model, else bf16."""
    return torch.float32 if model_dtype == torch.float32 else torch.bfloat16
