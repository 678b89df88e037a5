"""Many tokens through resident experts: sort (token, slot) rows by expert, then grouped GEMMs.

The reference SparseMoE loops over every expert with `torch.where` and a host sync per layer:
128 small launches per kernel kind per layer for Qwen3-30B-A3B. Here the T*k routed rows are
sorted by expert once; expert e owns the contiguous rows offsets[e-1]:offsets[e]. Then:

- `torch._grouped_mm` (cuBLAS/CUTLASS grouped GEMM; CPU too) multiplies every group by its
  expert's weights in one launch per projection, with the offsets on the device: no host sync.
- Where it is missing or refuses the inputs, a loop over only the experts that got rows, on
  contiguous slices of the sorted rows (one host sync for the counts).

Each row's routing weight scales its activation [R, I] before the down projection (I is
narrower than H: 768 against 2048 for Qwen3-30B-A3B), rows go back to token order by one
index_copy, and each token's k rows are summed in float32.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

# None: not tried yet; learned on first use because support depends on the build and the GPU.
_grouped_mm_works: bool | None = None


def grouped_mm_supported(x: torch.Tensor) -> bool:
    """Whether torch._grouped_mm may run for x's device and dtype (CUDA: bf16 only)."""
    if not hasattr(torch, "_grouped_mm") or _grouped_mm_works is False:
        return False
    return x.device.type == "cpu" or x.dtype == torch.bfloat16


def sort_by_expert(ids: torch.Tensor, num_experts: int):
    """(order [T*k], source token [T*k], offsets [E] int32) of the routed rows sorted by expert.

    ids [T, k]; sorted row r is flat row order[r], i.e. token order[r] // k; expert e owns
    sorted rows offsets[e-1]..offsets[e]-1.
    """
    flat = ids.reshape(-1)  # [T*k]
    order = torch.argsort(flat, stable=True)  # [T*k]
    counts = torch.bincount(flat, minlength=num_experts)  # [E]
    return order, order // ids.shape[1], torch.cumsum(counts, 0).to(torch.int32)


def _grouped(rows: torch.Tensor, stacked, offsets: torch.Tensor, row_weights: torch.Tensor):
    # Weights are [E, out, in] like nn.Linear; the transpose is the column-major B it wants.
    gate = torch._grouped_mm(rows, stacked.gate_proj.transpose(-2, -1), offs=offsets)  # [R, I]
    up = torch._grouped_mm(rows, stacked.up_proj.transpose(-2, -1), offs=offsets)  # [R, I]
    act = F.silu(gate) * up * row_weights[:, None]
    return torch._grouped_mm(act, stacked.down_proj.transpose(-2, -1), offs=offsets)  # [R, H]


def _looped(rows: torch.Tensor, stacked, offsets: torch.Tensor, row_weights: torch.Tensor):
    out = torch.empty_like(rows)  # [R, H]
    ends = offsets.tolist()  # the one host sync
    begin = 0
    for expert, end in enumerate(ends):
        if end > begin:  # experts without rows cost nothing
            part = rows[begin:end]  # [n, H]
            act = F.silu(F.linear(part, stacked.gate_proj[expert])) * F.linear(
                part, stacked.up_proj[expert]) * row_weights[begin:end, None]  # [n, I]
            out[begin:end] = F.linear(act, stacked.down_proj[expert])
        begin = end
    return out


def experts_sorted(moe, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The routed experts of x [T, H] with weights/ids [T, k]; returns [T, H] in x's dtype."""
    global _grouped_mm_works
    num_tokens, top_k = ids.shape
    stacked = moe.experts
    order, source, offsets = sort_by_expert(ids, stacked.gate_proj.shape[0])
    rows = x.index_select(0, source)  # [T*k, H], grouped by expert
    row_weights = weights.reshape(-1).index_select(0, order)  # [T*k], same order
    y = None
    if grouped_mm_supported(x):
        try:
            y = _grouped(rows, stacked, offsets, row_weights)
            _grouped_mm_works = True
        except RuntimeError as exc:
            if _grouped_mm_works:  # it worked before: this is a real error, not a capability
                raise
            _grouped_mm_works = False
            log.warning("torch._grouped_mm refused the MoE prefill (%s); looping over experts",
                        exc)
    if y is None:
        y = _looped(rows, stacked, offsets, row_weights)
    unsorted = torch.empty_like(y).index_copy_(0, order, y)  # flat (token, slot) order
    return unsorted.view(num_tokens, top_k, -1).sum(dim=1, dtype=torch.float32).to(x.dtype)
