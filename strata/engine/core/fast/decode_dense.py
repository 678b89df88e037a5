"""One token's projections and norms as Triton kernels that chain by PDL (pdl.py).

For one token, cuBLAS runs Qwen3-30B-A3B's o_proj (2048 x 4096) as a split-K GEMM plus a
reduce kernel, 8.9 us for 16.8 MB, and every projection and norm is a separate launch with its
own ramp-up. Here:

- `gemv`: out = W @ x (+ bias) for x [1, K], W [N, K]. Each program owns BLOCK_ROWS output rows
  and reads the first column tile of its rows before waiting for x, so with PDL the weight
  reads start while the previous kernel drains.
- `add_rms_norm`: (h + y, rms_norm(h + y)) for one token in one program, rounded exactly as
  pointwise.add_rms_norm (the reference) rounds.

`use_gemv` decides per weight: small matrices, where the fixed costs weigh most, take the
kernel; large ones keep cuBLAS, which streams them near the bandwidth limit.
"""

from __future__ import annotations

import torch

from strata.engine.core.fast import moe_triton, pdl, pointwise
from strata.units import MIB

try:
    import triton
    import triton.language as tl

    from strata.engine.core.fast.moe_triton import tile_dot
    from strata.engine.core.fast.pdl import wait as pdl_wait
except ImportError:  # optional: the torch path needs neither
    triton = None

# Weights up to this size run through `gemv` in a decode step: Qwen3-30B-A3B's qkv (21 MB)
# and o_proj (16.8 MB); Llama-3-8B's MLP (117-235 MB) stays on cuBLAS.
GEMV_MAX_WEIGHT_BYTES = 64 * MIB
# (BLOCK_ROWS, BLOCK_COLS, num_warps, no UNROLL); the first is the CPU interpreter's choice.
GEMV_CONFIGS = ((1, 2048, 4, None), (2, 1024, 4, None), (2, 2048, 8, None), (4, 512, 4, None))


if triton is not None:

    @triton.jit
    def _gemv_kernel(
        x_ptr, w_ptr, b_ptr, out_ptr,
        num_rows: tl.constexpr, num_cols: tl.constexpr, HAS_BIAS: tl.constexpr,
        USE_PDL: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
    ):
        rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_ok = rows < num_rows
        base = rows[:, None].to(tl.int64) * num_cols
        # The first column tile of the weights: they never depend on the previous kernel.
        cols = tl.arange(0, BLOCK_COLS)
        col_ok = cols < num_cols
        w = tl.load(w_ptr + base + cols[None, :], mask=row_ok[:, None] & col_ok[None, :],
                    other=0.0)
        pdl_wait(USE_PDL)
        x = tl.load(x_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        acc = tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        for start in range(BLOCK_COLS, num_cols, BLOCK_COLS):
            acc += tile_dot(w_ptr, base, x_ptr, start, row_ok, num_cols, BLOCK_COLS)
        if HAS_BIAS:
            acc += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + rows, acc.to(out_ptr.dtype.element_ty), mask=row_ok)

    @triton.jit
    def _add_rms_norm_kernel(
        h_ptr, y_ptr, w_ptr, h_out_ptr, x_out_ptr, eps,
        hidden: tl.constexpr, HAS_RESIDUAL: tl.constexpr, USE_PDL: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        cols = tl.arange(0, BLOCK)
        ok = cols < hidden
        weight = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        pdl_wait(USE_PDL)
        h = tl.load(h_ptr + cols, mask=ok, other=0.0)
        if HAS_RESIDUAL:
            # Rounded to the activation dtype before the statistics, as `h + y` is in torch.
            h = (h.to(tl.float32) + tl.load(y_ptr + cols, mask=ok, other=0.0).to(tl.float32))
            h = h.to(h_out_ptr.dtype.element_ty)
            tl.store(h_out_ptr + cols, h, mask=ok)
        h32 = h.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(h32 * h32, axis=0) / hidden + eps)
        normed = (h32 * rstd).to(x_out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(x_out_ptr + cols, (weight * normed).to(x_out_ptr.dtype.element_ty), mask=ok)

    _gemv_tuned = moe_triton.tuned(_gemv_kernel, GEMV_CONFIGS)


def use_gemv(weight: torch.Tensor) -> bool:
    """Whether a decode step multiplies by `weight` [N, K] with `gemv` rather than cuBLAS."""
    return (weight.dim() == 2 and weight.stride(-1) == 1 and weight.stride(0) == weight.shape[1]
            and weight.numel() * weight.element_size() <= GEMV_MAX_WEIGHT_BYTES)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         use_pdl: bool = False) -> torch.Tensor:
    """F.linear(x, weight, bias) for one token x [1, K] (or [K]); [1, N] in x's dtype."""
    num_rows, num_cols = weight.shape
    if x.numel() != num_cols or not use_gemv(weight):
        raise ValueError(f"gemv takes one token of {num_cols} values and a contiguous weight of "
                         f"at most {GEMV_MAX_WEIGHT_BYTES} bytes; got x {tuple(x.shape)}, "
                         f"weight {tuple(weight.shape)} strides {weight.stride()}")
    out = torch.empty(1, num_rows, dtype=x.dtype, device=x.device)
    moe_triton.launch(
        _gemv_tuned, lambda rows: (triton.cdiv(num_rows, rows),), GEMV_CONFIGS,
        x.contiguous(), weight, bias if bias is not None else weight, out,
        num_rows=num_rows, num_cols=num_cols, HAS_BIAS=bias is not None, use_pdl=use_pdl,
    )
    return out


def add_rms_norm(h: torch.Tensor, y: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 use_pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + y, rms_norm(h + y)) for one token h, y [1, H]; y None: (h, rms_norm(h))."""
    hidden = weight.shape[0]
    if h.numel() != hidden or (y is not None and y.numel() != hidden):
        raise ValueError(f"add_rms_norm takes one token of {hidden} values, got "
                         f"{tuple(h.shape)} and {None if y is None else tuple(y.shape)}")
    h_out = torch.empty_like(h) if y is not None else h
    x_out = torch.empty_like(h)
    block = triton.next_power_of_2(hidden)
    _add_rms_norm_kernel[(1,)](
        h.contiguous(), (y if y is not None else h).contiguous(), weight, h_out, x_out, eps,
        hidden=hidden, HAS_RESIDUAL=y is not None, BLOCK=block,
        num_warps=8 if block >= 2048 else 4, **pdl.launch_options(use_pdl),
    )
    return h_out, x_out


def check_kernels(model: torch.nn.Module, use_pdl: bool) -> str:
    """'' when gemv and add_rms_norm match torch for this model's hidden size and dtype on its
    device; else why.

    Runs once per decoder before any graph capture (with PDL launches where they will be
    used), so a kernel that fails to compile or disagrees on this GPU costs a logged fallback,
    not a wrong answer. gemv multiplies a random [256, hidden] matrix: a model whose own
    projections are all too large for gemv still gets the norm kernel and PDL.
    """
    norm = model.model.layers[0].post_attention_layernorm
    device, dtype = norm.weight.device, norm.weight.dtype
    if not moe_triton.is_usable(device):  # False without Triton too
        return f"Triton cannot run on {device}"
    hidden = norm.weight.shape[0]
    gen = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    weight = rand(256, hidden) * hidden**-0.5
    x, h, y = rand(1, hidden), rand(1, hidden), rand(1, hidden)
    try:
        with torch.inference_mode():
            got = [gemv(x, weight, None, use_pdl), *add_rms_norm(h, y, norm.weight, norm.eps,
                                                                 use_pdl)]
            expected = [torch.nn.functional.linear(x, weight),
                        *pointwise.add_rms_norm(h, y, norm.weight, norm.eps)]
    except Exception as exc:  # noqa: BLE001 - any compile or launch error means: do not use
        return f"{type(exc).__name__}: {str(exc)[:200]}"
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    for name, a, b in zip(("gemv", "residual", "norm"), got, expected):
        scale = max(b.float().abs().max().item(), 1.0)
        error = (a.float() - b.float()).abs().max().item() / scale
        if not error <= tolerance:
            return f"{name} mismatch: relative error {error:.3g}"
    return ""
