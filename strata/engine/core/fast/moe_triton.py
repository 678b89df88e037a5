"""Grouped matrix-vector Triton kernels for one token's top-k experts.

The expert ids stay in device memory: each program loads its expert id and reads only that
expert's rows of the stacked [E, I, H] / [E, H, I] weights, so the k experts cost exactly
their bytes and no host sync. gate and up are read in the same program and leave as
silu(gate) * up; down multiplies by the routing weight. Runs on CUDA, or on CPU tensors under
TRITON_INTERPRET=1 (the tests).
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is optional: the bmm and loop paths need only torch.
    triton = None

# Rows per program and columns per load: 16 x 256 bf16 is an 8 KiB tile, enough bytes in
# flight per warp group to approach HBM bandwidth with thousands of programs.
GATE_UP_BLOCK_ROWS = 16
DOWN_BLOCK_ROWS = 8
BLOCK_COLS = 256
# Matrix sizes are constexpr: fixed per model, they give static loop bounds (and the CPU
# interpreter cannot take a runtime loop bound with numpy 2).


def is_usable(device: torch.device) -> bool:
    """Triton imported and able to run here (a CUDA device, or the CPU interpreter)."""
    if triton is None:
        return False
    if device.type == "cuda":
        return True
    return os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:

    @triton.jit
    def _gate_up_kernel(
        x_ptr, gate_ptr, up_ptr, ids_ptr, out_ptr,
        stride_expert, stride_row,
        num_cols: tl.constexpr, num_rows: tl.constexpr,
        BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
    ):
        slot = tl.program_id(0)
        rows = tl.program_id(1) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        expert = tl.load(ids_ptr + slot).to(tl.int64)
        row_ok = rows < num_rows
        base = expert * stride_expert + rows[:, None].to(tl.int64) * stride_row
        acc_gate = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
        for start in range(0, num_cols, BLOCK_COLS):
            cols = start + tl.arange(0, BLOCK_COLS)
            col_ok = cols < num_cols
            xv = tl.load(x_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
            ok = row_ok[:, None] & col_ok[None, :]
            g = tl.load(gate_ptr + base + cols[None, :], mask=ok, other=0.0).to(tl.float32)
            u = tl.load(up_ptr + base + cols[None, :], mask=ok, other=0.0).to(tl.float32)
            acc_gate += tl.sum(g * xv[None, :], axis=1)
            acc_up += tl.sum(u * xv[None, :], axis=1)
        act = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up  # silu(gate) * up
        out = out_ptr + slot * num_rows + rows
        tl.store(out, act.to(out_ptr.dtype.element_ty), mask=row_ok)

    @triton.jit
    def _down_kernel(
        act_ptr, down_ptr, ids_ptr, weights_ptr, out_ptr,
        stride_expert, stride_row,
        num_cols: tl.constexpr, num_rows: tl.constexpr,
        BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
    ):
        slot = tl.program_id(0)
        rows = tl.program_id(1) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        expert = tl.load(ids_ptr + slot).to(tl.int64)
        weight = tl.load(weights_ptr + slot).to(tl.float32)
        row_ok = rows < num_rows
        base = expert * stride_expert + rows[:, None].to(tl.int64) * stride_row
        acc = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
        for start in range(0, num_cols, BLOCK_COLS):
            cols = start + tl.arange(0, BLOCK_COLS)
            col_ok = cols < num_cols
            a = tl.load(act_ptr + slot * num_cols + cols, mask=col_ok, other=0.0).to(tl.float32)
            ok = row_ok[:, None] & col_ok[None, :]
            w = tl.load(down_ptr + base + cols[None, :], mask=ok, other=0.0).to(tl.float32)
            acc += tl.sum(w * a[None, :], axis=1)
        tl.store(out_ptr + slot * num_rows + rows, acc * weight, mask=row_ok)


def _check_stacked(name: str, weight: torch.Tensor) -> None:
    if weight.dim() != 3 or weight.stride(-1) != 1 or weight.stride(-2) != weight.shape[-1]:
        raise ValueError(
            f"{name} must be a stacked [E, rows, cols] tensor with contiguous rows, got shape "
            f"{tuple(weight.shape)} strides {weight.stride()}: use the loop or bmm MoE path"
        )


def grouped_gate_up(
    x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """silu(gate[ids[j]] @ x) * (up[ids[j]] @ x) for each j: x [H], gate/up [E, I, H] -> [k, I]."""
    _check_stacked("gate_proj", gate)
    _check_stacked("up_proj", up)
    num_experts_used = ids.shape[0]
    num_rows, num_cols = gate.shape[1], gate.shape[2]
    out = torch.empty(num_experts_used, num_rows, dtype=x.dtype, device=x.device)
    grid = (num_experts_used, triton.cdiv(num_rows, GATE_UP_BLOCK_ROWS))
    _gate_up_kernel[grid](
        x.contiguous(), gate, up, ids.contiguous(), out,
        gate.stride(0), gate.stride(1), num_cols=num_cols, num_rows=num_rows,
        BLOCK_ROWS=GATE_UP_BLOCK_ROWS, BLOCK_COLS=BLOCK_COLS,
    )
    return out


def grouped_down(
    act: torch.Tensor, down: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """weights[j] * (down[ids[j]] @ act[j]) for each j: act [k, I], down [E, H, I] -> [k, H] fp32."""
    _check_stacked("down_proj", down)
    num_experts_used = ids.shape[0]
    num_rows, num_cols = down.shape[1], down.shape[2]
    out = torch.empty(num_experts_used, num_rows, dtype=torch.float32, device=act.device)
    grid = (num_experts_used, triton.cdiv(num_rows, DOWN_BLOCK_ROWS))
    _down_kernel[grid](
        act.contiguous(), down, ids.contiguous(), weights.contiguous(), out,
        down.stride(0), down.stride(1), num_cols=num_cols, num_rows=num_rows,
        BLOCK_ROWS=DOWN_BLOCK_ROWS, BLOCK_COLS=BLOCK_COLS,
    )
    return out
