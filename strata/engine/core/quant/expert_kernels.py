"""Triton kernels over quantized experts (experts.py): gather the routed experts' blocks and
dequantize them, for decode without a host sync (whole stacks: dequant.dequantize_experts).
Decode of the types gemv_planes.py reads skips this: expert_gemv.py's fused kernels.

Imported on first use (like kernels.py): importing it decorates a Triton kernel, which must
wait until a test has chosen the CPU interpreter.
"""

from __future__ import annotations

import torch

from strata.engine.core.kernels.launch import is_interpreting, slot_table_arg
from strata.engine.core.quant import dequant_tile as dt
from strata.engine.core.quant.experts import QuantizedExperts
from strata.engine.core.quant.lookup import lookup_table

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

GATHER_BLOCK_N, GATHER_BLOCK_K = 16, 256
INTERPRETER_GATHER_BLOCK_N = 128  # the interpreter pays per program, not per value

if triton is not None:

    # Per-layer offsets and strides: never specialized, so a new layer never compiles again
    # (a CUDA graph capture cannot hold a compile).
    @triton.jit(do_not_specialize=["host_offset", "stride_expert"])
    def _gather_kernel(
        w_ptr, wh_ptr, lut_ptr, ids_ptr, table_ptr, host_offset, out_ptr, stride_expert,
        N: tl.constexpr, K: tl.constexpr, ROW_BYTES: tl.constexpr, QTYPE: tl.constexpr,
        HAS_TABLE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        j = tl.program_id(0)
        rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = tl.program_id(2) * BLOCK_K + tl.arange(0, BLOCK_K)
        ok = (rows < N)[:, None] & (cols < K)[None, :]
        expert = tl.load(ids_ptr + j).to(tl.int64)
        base = expert * stride_expert
        if HAS_TABLE:  # a partial cache: the slot, or (-1) the host copy host_offset bytes on
            slot = tl.load(table_ptr + expert).to(tl.int64)
            base = tl.where(slot >= 0, slot * stride_expert, host_offset + base)
        row_off = (base + rows.to(tl.int64) * ROW_BYTES)[:, None]
        v = dt.dequant_tile(w_ptr, wh_ptr, lut_ptr, row_off, cols[None, :], ok, QTYPE)
        out = out_ptr + (j * N + rows).to(tl.int64)[:, None] * K + cols[None, :]
        tl.store(out, v.to(out_ptr.dtype.element_ty), mask=ok)


def gather_dequantize(experts: QuantizedExperts, ids: torch.Tensor,
                      table: torch.Tensor | None = None, host_offset: int = 0,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """Experts ids [k] (device memory, no host sync) dequantized into [k, N, K].

    With a partial expert cache, experts are its slots, table [E] int32 holds expert e's
    slot or -1, and a -1 expert is read from the host copy, whose [E, N, row_bytes] blocks
    start host_offset bytes past the slots' base (mapped for the device)."""
    num_ids = ids.shape[0]
    _, rows, cols = experts.shape
    if out is None:
        out = torch.empty(num_ids, rows, cols, dtype=experts.dtype, device=experts.device)
    if num_ids == 0:
        return out
    if host_offset % 2:
        raise ValueError("the host copy must sit an even number of bytes from the slots")
    raw = experts.raw
    block_n = (INTERPRETER_GATHER_BLOCK_N if is_interpreting() else GATHER_BLOCK_N)
    grid = (num_ids, triton.cdiv(rows, block_n), triton.cdiv(cols, GATHER_BLOCK_K))
    # No contraction: the values equal gguf-py's before the final rounding (kernels.py).
    _gather_kernel[grid](
        raw, raw.view(torch.float16),  # the fp16 fields, at even offsets (stride checked)
        lookup_table(raw.device), ids.contiguous(), slot_table_arg(table, ids),
        int(host_offset), out, experts.expert_stride,
        N=rows, K=cols, ROW_BYTES=raw.shape[2], QTYPE=int(experts.qtype),
        HAS_TABLE=table is not None, BLOCK_N=block_n, BLOCK_K=GATHER_BLOCK_K,
        enable_fp_fusion=False,
    )
    return out


def dequantize_routed(
    gate: QuantizedExperts, up: QuantizedExperts, down: QuantizedExperts, ids: torch.Tensor,
    table: torch.Tensor | None = None, host_offsets: tuple[int, int, int] = (0, 0, 0),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(gate [k, I, H], up [k, I, H], down [k, H, I], local ids 0..k-1): the routed experts of
    one token dequantized, and the ids the grouped kernels then read them by."""
    stacks = [gather_dequantize(w, ids, table, offset)
              for w, offset in zip((gate, up, down), host_offsets)]
    return (*stacks, torch.arange(ids.shape[0], device=ids.device))  # type: ignore[return-value]
