"""MoE experts held as GGML blocks, and how the expert matmuls read them: dequantized on use.

A QuantizedExperts is one projection (gate, up or down) of a layer's E experts: raw uint8
[E, N, row_bytes], rows contiguous, experts `expert_stride` bytes apart (an expert store pads
every layer's experts to the largest type any layer uses, so one slot fits them all). The
expert matmuls themselves stay float; what they need is dequantized just before:

- one token (decode, CUDA-graph safe): the types gemv_planes.py decodes go through
  expert_gemv.py's fused kernels, which read the k routed experts' blocks once (ids in device
  memory; through a partial cache's slot table, a missing expert is read in place from the
  pinned host copy). Other types: `gather_dequantize` (expert_kernels.py) dequantizes the k
  routed experts into [k, N, K], and the grouped kernels run over them with ids 0..k-1.
- many tokens (prefill): few rows per expert take expert_gemm.py's grouped kernels, which
  decode the blocks inside their K loop; more take expert_grouped.py, which dequantizes the
  experts (dequant.py) a bounded group at a time and runs torch's grouped GEMM per group
  (fast/moe_prefill.py chooses by the routed rows).
- the reference loop: `ExpertMatrices` gives one expert's QuantizedWeight (`weight`), which
  qlinear multiplies from its blocks (a few tokens) or dequantizes (more); indexing
  dequantizes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from strata.engine.core.quant.weight import QuantizedWeight


@dataclass(frozen=True, eq=False)
class QuantizedExperts:
    """A [E, N, K] stack of expert matrices held as GGML blocks; values come out in `dtype`."""

    qtype: GGMLQuantizationType
    shape: tuple[int, int, int]  # logical [E, N, K]
    raw: torch.Tensor  # uint8 [E, N, row_bytes], rows contiguous
    dtype: torch.dtype

    def __post_init__(self) -> None:
        block_size, block_bytes = GGML_QUANT_SIZES[self.qtype]
        experts, rows, cols = self.shape
        row_bytes = cols // block_size * block_bytes
        raw = self.raw
        if (cols % block_size or raw.dtype != torch.uint8
                or tuple(raw.shape) != (experts, rows, row_bytes)
                or raw.stride()[1:] != (row_bytes, 1) or raw.stride(0) % 2):
            raise ValueError(f"{self.qtype.name} blocks of {experts} [{rows}, {cols}] experts "
                             f"must be uint8 ({experts}, {rows}, {row_bytes}) with contiguous "
                             f"rows, got {raw.dtype} {tuple(raw.shape)} strides {raw.stride()}")

    @property
    def num_experts(self) -> int:
        return self.shape[0]

    @property
    def device(self) -> torch.device:
        return self.raw.device

    @property
    def expert_stride(self) -> int:
        """Bytes from one expert's blocks to the next's."""
        return self.raw.stride(0)

    @property
    def nbytes(self) -> int:
        return self.raw[0].numel() * self.num_experts

    def numel(self) -> int:
        return self.shape[0] * self.shape[1] * self.shape[2]

    def expert(self, index: int) -> QuantizedWeight:
        """Expert `index`'s matrix [N, K] as a QuantizedWeight (a view)."""
        return QuantizedWeight(self.qtype, self.shape[1:], self.raw[index], self.dtype)

    def narrow(self, first: int, count: int) -> QuantizedExperts:
        """Experts first..first+count-1 (a view)."""
        return QuantizedExperts(self.qtype, (count, *self.shape[1:]),
                                self.raw[first : first + count], self.dtype)


def fp16_view(raw: torch.Tensor) -> torch.Tensor:
    """GGML blocks as float16, the kernels' view of their fp16 fields (d, dmin). MXFP4 has no
    such field and its 17-byte blocks can make a row odd: then the bytes themselves, which
    the kernels never read as halves."""
    return raw.view(torch.float16) if raw.shape[-1] % 2 == 0 else raw


def is_quantized_experts(weight: object) -> bool:
    return isinstance(weight, QuantizedExperts)


class ExpertMatrices(Sequence):
    """The matrices of experts ids[j] (default: every expert), each dequantized when indexed:
    the reference loop uses one at a time, so one matrix per projection exists at once."""

    def __init__(self, experts: QuantizedExperts, ids: Sequence[int] | None = None):
        self.experts = experts
        self.ids = list(range(experts.num_experts)) if ids is None else list(ids)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, j):  # type: ignore[override]
        if isinstance(j, slice):
            raise TypeError("ExpertMatrices are indexed one expert at a time")
        return self.experts.expert(self.ids[j]).dequantize()

    def weight(self, j: int) -> QuantizedWeight:
        """Expert ids[j]'s matrix as blocks, for qlinear."""
        return self.experts.expert(self.ids[j])
