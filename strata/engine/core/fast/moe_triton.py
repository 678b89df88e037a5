"""Grouped matrix-vector Triton kernels for one token's top-k experts: three launches a layer.

1. `route_topk`: softmax over the router logits, top-k, renormalisation, in one program.
2. `grouped_gate_up`: silu(gate[e] @ x) * (up[e] @ x) for the k experts; gate and up rows are
   read in the same program.
3. `grouped_down_sum`: sum_j w_j * down[e_j] @ act_j; every program owns output rows and
   loops over the k experts, so the weighted sum and the cast need no extra kernels.

The expert ids stay in device memory: each program loads its expert id and reads only that
expert's rows of the stacked [E, I, H] / [E, H, I] weights, so the k experts cost exactly
their bytes and no host sync. On CUDA the block shapes are autotuned once per matrix shape
(the candidates include the first pass's fixed choice); under TRITON_INTERPRET=1 (the CPU
tests) the first candidate runs.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is optional: the bmm and loop paths need only torch.
    triton = None

# (BLOCK_ROWS, BLOCK_COLS, num_warps) candidates; the first is the CPU interpreter's choice.
# From a sweep of 240 shapes on an H200 for Qwen3-30B-A3B (8 of 128 experts, I=768, H=2048;
# docs/bench-results/sweep-moe-h200.json): few rows and wide column tiles keep many loads in
# flight per program. gate/up: 4 x 1024 with 2 warps 12.3 us (4.1 TB/s) against 18.0 us for
# the earlier 8 x 256; down: 4 x 256 with 4 warps 6.8 us (3.7 TB/s). The runners-up stay as
# candidates for other shapes.
GATE_UP_CONFIGS = ((4, 1024, 2), (8, 1024, 4), (1, 2048, 4), (4, 512, 2))
DOWN_SUM_CONFIGS = ((4, 256, 4), (2, 256, 2), (1, 1024, 2), (4, 1024, 4))
# Matrix sizes are constexpr: fixed per model, they give static loop bounds (and the CPU
# interpreter cannot take a runtime loop bound with numpy 2).


def _is_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def is_usable(device: torch.device) -> bool:
    """Triton imported and able to run here (a CUDA device, or the CPU interpreter)."""
    if triton is None:
        return False
    if device.type == "cuda":
        return True
    return os.environ.get("TRITON_INTERPRET") == "1"


def _tuned(kernel, candidates):
    """The kernel autotuned over candidates on CUDA (keyed by matrix shape); as is when interpreting."""
    if _is_interpreting():
        return kernel
    configs = [triton.Config({"BLOCK_ROWS": r, "BLOCK_COLS": c}, num_warps=w)
               for r, c, w in candidates]
    # Kernels only store (no accumulation into outputs), so timing reruns are harmless.
    return triton.autotune(configs=configs, key=["num_rows", "num_cols"])(kernel)


def _launch(kernel, grid_for_rows, candidates, *args, **kwargs) -> None:
    if _is_interpreting():
        rows, cols, warps = candidates[0]
        kernel[grid_for_rows(rows)](*args, **kwargs, BLOCK_ROWS=rows, BLOCK_COLS=cols,
                                     num_warps=warps)
    else:
        kernel[lambda meta: grid_for_rows(meta["BLOCK_ROWS"])](*args, **kwargs)


if triton is not None:

    @triton.jit
    def _route_kernel(
        logits_ptr, ids_ptr, weights_ptr,
        num_experts: tl.constexpr, top_k: tl.constexpr, norm_topk: tl.constexpr,
        BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        experts = tl.arange(0, BLOCK_E)
        ok = experts < num_experts
        z = tl.load(logits_ptr + experts, mask=ok, other=float("-inf")).to(tl.float32)
        e = tl.exp(z - tl.max(z, axis=0))
        probs = tl.where(ok, e / tl.sum(e, axis=0), -1.0)  # padding never wins
        slots = tl.arange(0, BLOCK_K)
        top_p = tl.zeros([BLOCK_K], dtype=tl.float32)
        top_id = tl.zeros([BLOCK_K], dtype=tl.int64)
        for j in tl.static_range(top_k):  # descending, like torch.topk
            best = tl.argmax(probs, axis=0)
            top_p = tl.where(slots == j, tl.max(probs, axis=0), top_p)
            top_id = tl.where(slots == j, best.to(tl.int64), top_id)
            probs = tl.where(experts == best, -1.0, probs)
        if norm_topk:
            top_p = top_p / tl.sum(top_p, axis=0)
        tl.store(ids_ptr + slots, top_id, mask=slots < top_k)
        tl.store(weights_ptr + slots, top_p.to(weights_ptr.dtype.element_ty), mask=slots < top_k)

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
    def _down_sum_kernel(
        act_ptr, down_ptr, ids_ptr, weights_ptr, out_ptr,
        stride_expert, stride_row,
        num_cols: tl.constexpr, num_rows: tl.constexpr, top_k: tl.constexpr,
        BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
    ):
        rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_ok = rows < num_rows
        acc = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
        for slot in tl.static_range(top_k):
            expert = tl.load(ids_ptr + slot).to(tl.int64)
            weight = tl.load(weights_ptr + slot).to(tl.float32)
            base = expert * stride_expert + rows[:, None].to(tl.int64) * stride_row
            part = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
            for start in range(0, num_cols, BLOCK_COLS):
                cols = start + tl.arange(0, BLOCK_COLS)
                col_ok = cols < num_cols
                a = tl.load(act_ptr + slot * num_cols + cols, mask=col_ok, other=0.0)
                ok = row_ok[:, None] & col_ok[None, :]
                w = tl.load(down_ptr + base + cols[None, :], mask=ok, other=0.0).to(tl.float32)
                part += tl.sum(w * a.to(tl.float32)[None, :], axis=1)
            acc += weight * part
        tl.store(out_ptr + rows, acc.to(out_ptr.dtype.element_ty), mask=row_ok)

    _gate_up_tuned = _tuned(_gate_up_kernel, GATE_UP_CONFIGS)
    _down_sum_tuned = _tuned(_down_sum_kernel, DOWN_SUM_CONFIGS)


def _check_stacked(name: str, weight: torch.Tensor) -> None:
    if weight.dim() != 3 or weight.stride(-1) != 1 or weight.stride(-2) != weight.shape[-1]:
        raise ValueError(
            f"{name} must be a stacked [E, rows, cols] tensor with contiguous rows, got shape "
            f"{tuple(weight.shape)} strides {weight.stride()}: use the loop or bmm MoE path"
        )


def route_topk(
    logits: torch.Tensor, top_k: int, norm_topk_prob: bool, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [k] in dtype, ids [k] int64) from one token's router logits [E], as SparseMoE routes.

    softmax in float32, top-k descending, optionally renormalised to sum to 1.
    """
    num_experts = logits.shape[-1]
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k must be in 1..{num_experts}, not {top_k}")
    ids = torch.empty(top_k, dtype=torch.long, device=logits.device)
    weights = torch.empty(top_k, dtype=dtype, device=logits.device)
    _route_kernel[(1,)](
        logits.reshape(-1).contiguous(), ids, weights, num_experts=num_experts, top_k=top_k,
        norm_topk=norm_topk_prob, BLOCK_E=triton.next_power_of_2(num_experts),
        BLOCK_K=triton.next_power_of_2(top_k),
    )
    return weights, ids


def grouped_gate_up(
    x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """silu(gate[ids[j]] @ x) * (up[ids[j]] @ x) for each j: x [H], gate/up [E, I, H] -> [k, I]."""
    _check_stacked("gate_proj", gate)
    _check_stacked("up_proj", up)
    num_experts_used = ids.shape[0]
    num_rows, num_cols = gate.shape[1], gate.shape[2]
    out = torch.empty(num_experts_used, num_rows, dtype=x.dtype, device=x.device)
    _launch(
        _gate_up_tuned, lambda rows: (num_experts_used, triton.cdiv(num_rows, rows)),
        GATE_UP_CONFIGS, x.contiguous(), gate, up, ids.contiguous(), out,
        gate.stride(0), gate.stride(1), num_cols=num_cols, num_rows=num_rows,
    )
    return out


def grouped_down_sum(
    act: torch.Tensor, down: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """sum_j weights[j] * (down[ids[j]] @ act[j]): act [k, I], down [E, H, I] -> [H] in act's dtype.

    The sum runs in float32 inside the kernel; one rounding at the end.
    """
    _check_stacked("down_proj", down)
    num_rows, num_cols = down.shape[1], down.shape[2]
    out = torch.empty(num_rows, dtype=act.dtype, device=act.device)
    _launch(
        _down_sum_tuned, lambda rows: (triton.cdiv(num_rows, rows),), DOWN_SUM_CONFIGS,
        act.contiguous(), down, ids.contiguous(), weights.contiguous(), out,
        down.stride(0), down.stride(1), num_cols=num_cols, num_rows=num_rows,
        top_k=ids.shape[0],
    )
    return out
