"""One token's projections and norms as Triton kernels that chain by PDL (pdl.py).

For one token, cuBLAS runs Qwen3-30B-A3B's o_proj (2048 x 4096) as a split-K GEMM plus a
reduce kernel, and every projection and norm is a separate launch with its own ramp-up. Here:

- `gemv`: out = W @ x (+ bias) for x [1, K], W [N, K]. Each program owns BLOCK_ROWS output rows
  and reads the first column tile of its rows before waiting for x, so with PDL the weight
  reads start while the previous kernel drains.
- `add_rms_norm`: (h + y, rms_norm(h + y)) for one token in one program, rounded exactly as
  pointwise.add_rms_norm (the reference) rounds.
- `norm_gemv` and `silu_mul_gemv`: the same GEMV with the step before it done in its prologue,
  for weights up to PROLOGUE_MAX_WEIGHT_BYTES (`use_prologue`), so a small dense layer is 6
  launches, not 9. A small model's decode step is bound by its launches, which cost about
  the same whatever their size (docs/benchmarks.md, "Figures behind the fast path"). Every program
  recomputes the norm's statistics over the whole token (a few KB from L2); the first one
  writes h + y.

Gemma's variants are compile-time flags: the (1 + w) norm (UNIT_OFFSET), GeGLU's gelu_tanh in
the activation prologue (GELU_MUL), and its post-sublayer norm of y done in the residual
add's launch (Y_NORM).

`use_gemv` decides per weight: small matrices, where the fixed costs weigh most, take the
kernel; large ones keep cuBLAS, which streams them near the bandwidth limit.
"""

from __future__ import annotations

import torch

from strata.engine.core.fast import pointwise
from strata.engine.core.kernels import launch, pdl
from strata.engine.core.models.decoder import SandwichDecoderLayer
from strata.engine.core.models.layers import GeGLU
from strata.units import MIB

try:
    import triton
    import triton.language as tl

    from strata.engine.core.fast.moe_triton import tile_dot
    from strata.engine.core.kernels.pdl import wait as pdl_wait
    from strata.engine.core.quant.gemv_dp4a import round_and_store
except ImportError:  # optional: the torch path needs neither
    triton = None

# Weights up to this size run through `gemv` in a decode step: Qwen3-30B-A3B's qkv (21 MB)
# and o_proj (16.8 MB); Llama-3-8B's MLP (117-235 MB) stays on cuBLAS.
GEMV_MAX_WEIGHT_BYTES = 64 * MIB
# (BLOCK_ROWS, BLOCK_COLS, num_warps, no UNROLL), autotuned on CUDA; the CPU interpreter runs
# the first's columns over more rows (launch.interpreter_rows).
GEMV_CONFIGS = ((1, 2048, 4, None), (2, 1024, 4, None), (2, 2048, 8, None), (4, 512, 4, None))
GEMV_INTERPRETED = launch.interpreter_rows(GEMV_CONFIGS)  # made once: CUDA never reads it
# What a GEMV's prologue makes of its input before multiplying (see _token_tile).
PLAIN, SILU_MUL, NORM, GELU_MUL = 0, 1, 2, 3
# Weights up to this size take the step before them into their GEMV's prologue. Reading 8 MiB
# at HBM speed takes about what a launch costs, so dropping a launch pays; past it, every
# program's recomputed norm costs more than the launch it saves (measured on three models:
# docs/benchmarks.md, "Figures behind the fast path").
PROLOGUE_MAX_WEIGHT_BYTES = 8 * MIB


if triton is not None:

    _PLAIN = tl.constexpr(PLAIN)
    _SILU_MUL = tl.constexpr(SILU_MUL)
    _NORM = tl.constexpr(NORM)
    _GELU_MUL = tl.constexpr(GELU_MUL)

    @triton.jit
    def gelu_tanh(g):
        """gelu with the tanh approximation of float32 g (GeGLU's gate):
        0.5 g (1 + tanh(z)) = g * sigmoid(2 z), z = sqrt(2 / pi) * (g + 0.044715 g^3)."""
        return g * tl.sigmoid(1.5957691216057308 * (g + 0.044715 * g * g * g))

    @triton.jit
    def scale_normed(h32, rstd, weight, out_dtype: tl.constexpr, UNIT_OFFSET: tl.constexpr):
        """The norm's output of float32 h32: Llama's rounds the normed values to out_dtype
        before the weight scales them; Gemma's (UNIT_OFFSET) scales by 1 + weight in float32
        and rounds once (models/layers.py)."""
        if UNIT_OFFSET:
            return (h32 * rstd * (weight + 1.0)).to(out_dtype)
        return (weight * (h32 * rstd).to(out_dtype).to(tl.float32)).to(out_dtype)

    @triton.jit
    def _residual(h_ptr, y_ptr, cols, ok, HAS_RESIDUAL: tl.constexpr):
        """h (+ y) over cols, in h's dtype: rounded before any statistics, as `h + y` is."""
        h = tl.load(h_ptr + cols, mask=ok, other=0.0)
        if HAS_RESIDUAL:
            h = (h.to(tl.float32) + tl.load(y_ptr + cols, mask=ok, other=0.0).to(tl.float32))
            h = h.to(h_ptr.dtype.element_ty)
        return h

    @triton.jit
    def _token_tile(x_ptr, y_ptr, nw_ptr, h_out_ptr, cols, ok, rstd, store_h,
                    num_cols: tl.constexpr, PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                    UNIT_OFFSET: tl.constexpr):
        """One column tile of the vector a GEMV multiplies, float32: x; silu(gate) * up (or
        gelu_tanh(gate) * up) for x = [gate | up]; or rms_norm(h + y) for x = h (writing h + y
        where store_h). Rounded to the activation dtype where the separate kernels round."""
        if PROLOGUE == _SILU_MUL:
            gate = tl.load(x_ptr + cols, mask=ok, other=0.0).to(tl.float32)
            up = tl.load(x_ptr + num_cols + cols, mask=ok, other=0.0).to(tl.float32)
            v = (gate * tl.sigmoid(gate) * up).to(x_ptr.dtype.element_ty)
        elif PROLOGUE == _GELU_MUL:
            gate = tl.load(x_ptr + cols, mask=ok, other=0.0).to(tl.float32)
            up = tl.load(x_ptr + num_cols + cols, mask=ok, other=0.0).to(tl.float32)
            v = (gelu_tanh(gate) * up).to(x_ptr.dtype.element_ty)
        elif PROLOGUE == _NORM:
            h = _residual(x_ptr, y_ptr, cols, ok, HAS_RESIDUAL)
            if HAS_RESIDUAL:  # noqa: SIM102 - a constexpr test, folded when the kernel compiles
                if store_h:  # a branch, not a mask: Triton 3.9's interpreter rejects ok & store_h
                    tl.store(h_out_ptr + cols, h, mask=ok)
            weight = tl.load(nw_ptr + cols, mask=ok, other=0.0).to(tl.float32)
            v = scale_normed(h.to(tl.float32), rstd, weight, x_ptr.dtype.element_ty,
                             UNIT_OFFSET)
        else:
            v = tl.load(x_ptr + cols, mask=ok, other=0.0)
        return v.to(tl.float32)

    @triton.jit
    def _gemv_kernel(
        x_ptr, w_ptr, b_ptr, out_ptr, y_ptr, nw_ptr, h_out_ptr, eps,
        num_rows: tl.constexpr, num_cols: tl.constexpr, HAS_BIAS: tl.constexpr,
        PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, NORM_BLOCK: tl.constexpr,
        UNIT_OFFSET: tl.constexpr, USE_PDL: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
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
        rstd = 0.0
        if PROLOGUE == _NORM:
            # The whole token's statistics, summed as _add_rms_norm_kernel sums them.
            all_cols = tl.arange(0, NORM_BLOCK)
            h = _residual(x_ptr, y_ptr, all_cols, all_cols < num_cols, HAS_RESIDUAL)
            h = h.to(tl.float32)
            rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / num_cols + eps)
        store_h = tl.program_id(0) == 0
        x = _token_tile(x_ptr, y_ptr, nw_ptr, h_out_ptr, cols, col_ok, rstd, store_h,
                        num_cols, PROLOGUE, HAS_RESIDUAL, UNIT_OFFSET)
        acc = tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        for start in range(BLOCK_COLS, num_cols, BLOCK_COLS):
            if PROLOGUE == _PLAIN:
                acc += tile_dot(w_ptr, base, x_ptr, start, row_ok, num_cols, BLOCK_COLS)
            else:
                tile = start + tl.arange(0, BLOCK_COLS)
                tile_ok = tile < num_cols
                x = _token_tile(x_ptr, y_ptr, nw_ptr, h_out_ptr, tile, tile_ok, rstd, store_h,
                                num_cols, PROLOGUE, HAS_RESIDUAL, UNIT_OFFSET)
                w = tl.load(w_ptr + base + tile[None, :],
                            mask=row_ok[:, None] & tile_ok[None, :], other=0.0)
                acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        if HAS_BIAS:
            acc += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + rows, acc.to(out_ptr.dtype.element_ty), mask=row_ok)

    @triton.jit
    def _add_rms_norm_kernel(
        h_ptr, y_ptr, w_ptr, h_out_ptr, x_out_ptr, q_ptr, d_ptr, s_ptr, yw_ptr, eps, y_eps,
        hidden: tl.constexpr, HAS_RESIDUAL: tl.constexpr, ROUND: tl.constexpr,
        UNIT_OFFSET: tl.constexpr, Y_NORM: tl.constexpr, USE_PDL: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # ROUND: x's groups of 32 rounded to int8 too, for a dp4a product (decode_rounded.py).
        # Y_NORM: y is normed first by its own weight (Gemma's post-sublayer norm), rounded
        # to h's dtype as a separate norm launch would give it.
        cols = tl.arange(0, BLOCK)
        ok = cols < hidden
        weight = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        pdl_wait(USE_PDL)
        if Y_NORM:
            y32 = tl.load(y_ptr + cols, mask=ok, other=0.0).to(tl.float32)
            y_rstd = 1.0 / tl.sqrt(tl.sum(y32 * y32, axis=0) / hidden + y_eps)
            y_weight = tl.load(yw_ptr + cols, mask=ok, other=0.0).to(tl.float32)
            y = scale_normed(y32, y_rstd, y_weight, h_ptr.dtype.element_ty, UNIT_OFFSET)
            h = tl.load(h_ptr + cols, mask=ok, other=0.0)
            h = (h.to(tl.float32) + y.to(tl.float32)).to(h_ptr.dtype.element_ty)
        else:
            h = _residual(h_ptr, y_ptr, cols, ok, HAS_RESIDUAL)
        if HAS_RESIDUAL:
            tl.store(h_out_ptr + cols, h, mask=ok)
        h32 = h.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(h32 * h32, axis=0) / hidden + eps)
        x = scale_normed(h32, rstd, weight, x_out_ptr.dtype.element_ty, UNIT_OFFSET)
        tl.store(x_out_ptr + cols, x, mask=ok)
        if ROUND:  # past `hidden` x is 0 (masked loads): padded groups round to 0, unstored
            round_and_store(tl.reshape(x.to(tl.float32), (BLOCK // 32, 32)),
                            tl.arange(0, BLOCK // 32), hidden // 32, q_ptr, d_ptr, s_ptr)

    # Keyed by the prologue too: a norm or an activation in front changes the best tiles.
    _gemv_tuned = launch.tuned(_gemv_kernel, GEMV_CONFIGS,
                                   key=("num_rows", "num_cols", "PROLOGUE"))


def use_gemv(weight: torch.Tensor) -> bool:
    """Whether a decode step multiplies by `weight` [N, K] with `gemv` rather than cuBLAS."""
    return (weight.dim() == 2 and weight.stride(-1) == 1 and weight.stride(0) == weight.shape[1]
            and weight.numel() * weight.element_size() <= GEMV_MAX_WEIGHT_BYTES)


def use_prologue(weight: torch.Tensor) -> bool:
    """Whether the step before a product by `weight` runs in its GEMV's prologue
    (norm_gemv, silu_mul_gemv) rather than as a launch of its own."""
    return use_gemv(weight) and weight.numel() * weight.element_size() <= PROLOGUE_MAX_WEIGHT_BYTES


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         use_pdl: bool = False) -> torch.Tensor:
    """F.linear(x, weight, bias) for one token x [1, K] (or [K]); [1, N] in x's dtype."""
    _check_gemv(x, weight.shape[1], weight)
    return _launch_gemv(PLAIN, x, weight, bias, use_pdl)


def silu_mul_gemv(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  use_pdl: bool = False, gelu: bool = False) -> torch.Tensor:
    """F.linear(silu(gate) * up, weight, bias) for one token's gate_up [1, 2K] = [gate | up]
    and weight [N, K]: a SwiGLU down projection, activation included; [1, N]. gelu: GeGLU's
    gelu_tanh(gate) * up instead."""
    _check_gemv(gate_up, 2 * weight.shape[1], weight)
    return _launch_gemv(GELU_MUL if gelu else SILU_MUL, gate_up, weight, bias, use_pdl)


def norm_gemv(h: torch.Tensor, y: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
              weight: torch.Tensor, bias: torch.Tensor | None = None,
              use_pdl: bool = False, unit_offset: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + y, F.linear(rms_norm(h + y), weight, bias)) for one token h, y [1, H] (y None: h
    itself and the projection of rms_norm(h)): add_rms_norm then gemv in one launch.
    unit_offset: Gemma's norm (pointwise.rms_norm)."""
    hidden = norm_weight.shape[0]
    _check_gemv(h, hidden, weight)
    if weight.shape[1] != hidden or (y is not None and y.numel() != hidden):
        raise ValueError(f"norm_gemv takes one token of {hidden} values and a weight of "
                         f"{hidden} columns; got y {None if y is None else tuple(y.shape)}, "
                         f"weight {tuple(weight.shape)}")
    h_out = torch.empty_like(h) if y is not None else h
    out = _launch_gemv(NORM, h, weight, bias, use_pdl, y=y, norm_weight=norm_weight,
                       h_out=h_out, eps=eps, unit_offset=unit_offset)
    return h_out, out


def _check_gemv(x: torch.Tensor, num_values: int, weight: torch.Tensor) -> None:
    if x.numel() != num_values or not use_gemv(weight):
        raise ValueError(f"gemv takes one token of {num_values} values and a contiguous weight of "
                         f"at most {GEMV_MAX_WEIGHT_BYTES} bytes; got x {tuple(x.shape)}, "
                         f"weight {tuple(weight.shape)} strides {weight.stride()}")


def _launch_gemv(prologue: int, x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None, use_pdl: bool, y: torch.Tensor | None = None,
                 norm_weight: torch.Tensor | None = None, h_out: torch.Tensor | None = None,
                 eps: float = 0.0, unit_offset: bool = False) -> torch.Tensor:
    """One _gemv_kernel launch (prologue PLAIN, SILU_MUL or NORM); [1, N].
    Unused pointers get `weight`: the kernel never reads them."""
    num_rows, num_cols = weight.shape
    out = torch.empty(1, num_rows, dtype=x.dtype, device=x.device)
    launch.launch(
        _gemv_tuned, lambda rows: (triton.cdiv(num_rows, rows),),
        GEMV_INTERPRETED,
        x.contiguous(), weight, bias if bias is not None else weight, out,
        y.contiguous() if y is not None else weight,
        norm_weight if norm_weight is not None else weight,
        h_out if h_out is not None else weight, eps,
        num_rows=num_rows, num_cols=num_cols, HAS_BIAS=bias is not None, PROLOGUE=prologue,
        HAS_RESIDUAL=y is not None, NORM_BLOCK=triton.next_power_of_2(num_cols),
        UNIT_OFFSET=unit_offset, use_pdl=use_pdl,
    )
    return out


def add_rms_norm(h: torch.Tensor, y: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 use_pdl: bool = False, unit_offset: bool = False,
                 y_norm: tuple[torch.Tensor, float] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + y, rms_norm(h + y)) for one token h, y [1, H]; y None: (h, rms_norm(h)).
    unit_offset: Gemma's norm (pointwise.rms_norm), for both norms. y_norm: (weight, eps) of
    a norm applied to y first (Gemma's sandwich): (h + norm(y), rms_norm(h + norm(y)))."""
    h_out, x, _ = launch_add_rms_norm(h, y, weight, eps, use_pdl, None, unit_offset, y_norm)
    return h_out, x


def launch_add_rms_norm(h: torch.Tensor, y: torch.Tensor | None, weight: torch.Tensor,
                        eps: float, use_pdl: bool, rounded: tuple | None,
                        unit_offset: bool = False,
                        y_norm: tuple[torch.Tensor, float] | None = None) -> tuple:
    """add_rms_norm's one launch; rounded: empty (q, d, s) for x's int8 rounding, written
    by the same program (decode_rounded.add_rms_norm_rounded), or None. (h + y, x, rounded)."""
    hidden = weight.shape[0]
    if h.numel() != hidden or (y is not None and y.numel() != hidden):
        raise ValueError(f"add_rms_norm takes one token of {hidden} values, got "
                         f"{tuple(h.shape)} and {None if y is None else tuple(y.shape)}")
    if y_norm is not None and (y is None or y_norm[0].shape != weight.shape):
        raise ValueError("a norm of y needs y and a weight of the hidden size")
    h_out = torch.empty_like(h) if y is not None else h
    x_out = torch.empty_like(h)
    block = triton.next_power_of_2(hidden)
    y_weight, y_eps = y_norm if y_norm is not None else (weight, 0.0)
    _add_rms_norm_kernel[(1,)](
        h.contiguous(), (y if y is not None else h).contiguous(), weight, h_out, x_out,
        *(rounded if rounded is not None else (x_out, x_out, x_out)), y_weight, eps, y_eps,
        hidden=hidden, HAS_RESIDUAL=y is not None, ROUND=rounded is not None,
        UNIT_OFFSET=unit_offset, Y_NORM=y_norm is not None, BLOCK=block,
        num_warps=8 if block >= 2048 else 4, **pdl.launch_options(use_pdl),
    )
    return h_out, x_out, rounded


def check_kernels(model: torch.nn.Module, use_pdl: bool) -> str:
    """'' when gemv, add_rms_norm and the fused GEMVs match torch for this model's hidden size
    and dtype on its device; else why.

    Runs once per decoder before any graph capture (with PDL launches where they will be
    used), so a kernel that fails to compile or disagrees on this GPU costs a logged fallback,
    not a wrong answer. The GEMVs multiply random [256, hidden] matrices: a model whose own
    projections are all too large for gemv still gets the norm kernel and PDL.
    """
    norm = model.model.layers[0].post_attention_layernorm
    offset = pointwise.is_unit_offset(norm)  # the variants this model takes: Gemma's norm
    gelu = isinstance(model.model.layers[0].mlp, GeGLU)  # and GeGLU
    sandwich = isinstance(model.model.layers[0], SandwichDecoderLayer)  # and y's own norm
    act_mul = pointwise.gelu_mul if gelu else pointwise.silu_mul
    device, dtype = norm.weight.device, norm.weight.dtype
    if not launch.is_usable(device):  # False without Triton too
        return f"Triton cannot run on {device}"
    hidden = norm.weight.shape[0]
    gen = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    weight = rand(256, hidden) * hidden**-0.5
    x, h, y, gate_up = rand(1, hidden), rand(1, hidden), rand(1, hidden), rand(1, 2 * hidden)
    linear = torch.nn.functional.linear
    try:
        with torch.inference_mode():
            got = [gemv(x, weight, None, use_pdl),
                   *add_rms_norm(h, y, norm.weight, norm.eps, use_pdl, offset),
                   *norm_gemv(h, y, norm.weight, norm.eps, weight, None, use_pdl, offset),
                   norm_gemv(h, None, norm.weight, norm.eps, weight, None, use_pdl, offset)[1],
                   silu_mul_gemv(gate_up, weight, None, use_pdl, gelu)]
            h_sum, normed = pointwise.add_rms_norm(h, y, norm.weight, norm.eps, offset)
            expected = [linear(x, weight), h_sum, normed, h_sum, linear(normed, weight),
                        linear(pointwise.rms_norm(h, norm.weight, norm.eps, offset), weight),
                        linear(act_mul(*gate_up.chunk(2, dim=-1)), weight)]
            if sandwich:  # the norm of y first (Gemma's post-sublayer norm), then the add
                y_norm = model.model.layers[0].pre_feedforward_layernorm
                got += add_rms_norm(h, y, norm.weight, norm.eps, use_pdl, offset,
                                    (y_norm.weight, y_norm.eps))
                expected += pointwise.add_rms_norm(
                    h, pointwise.rms_norm(y, y_norm.weight, y_norm.eps, offset), norm.weight,
                    norm.eps, offset)
    except Exception as exc:  # noqa: BLE001 - any compile or launch error means: do not use
        return f"{type(exc).__name__}: {str(exc)[:200]}"
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    names = ("gemv", "residual", "norm", "norm_gemv residual", "norm_gemv",
             "norm_gemv without residual", "silu_mul_gemv", "residual of a normed y",
             "norm after a normed y")
    for name, a, b in zip(names, got, expected):
        scale = max(b.float().abs().max().item(), 1.0)
        error = (a.float() - b.float()).abs().max().item() / scale
        if not error <= tolerance:
            return f"{name} mismatch: relative error {error:.3g}"
    return ""
