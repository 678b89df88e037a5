"""The kernel before a one-token dp4a product writes x rounded to int8 as well.

A quantized product by dp4a (quant/gemv_dp4a.py) first rounds x to int8 per 32 values in a
launch of its own (`quantize_x`), and x itself comes from a norm or SiLU·mul launch: three
launches where the rounding could be the last lines of the kernel that makes x. In a decode
step bound by its chain of short kernels, each launch costs its ramp-up and drain
(docs/benchmarks.md, run 29). Here:

- `add_rms_norm_rounded`: decode_dense.add_rms_norm's kernel with its ROUND branch: the
  residual and the norm as it gives them, then the rounding of those bf16 values.
- `silu_mul_rounded`: silu(gate) * up rounded once to x's dtype (as decode_dense's SiLU·mul
  prologue and the compiled pointwise op round it), then to int8.

Both write x in its own dtype too, so a consumer that does not take dp4a reads x as before.
The rounding is `gemv_dp4a.round_and_store`, the one `quantize_x` uses: given the same x, the
int8 values, scales and sums are bit-identical.
"""

from __future__ import annotations

import torch

from strata.engine.core.fast.decode_dense import launch_add_rms_norm
from strata.engine.core.kernels import pdl
from strata.engine.core.quant.gemv_dp4a import X_GROUP, empty_rounding, quantize_x

try:
    import triton
    import triton.language as tl

    from strata.engine.core.fast.decode_dense import gelu_tanh
    from strata.engine.core.kernels.pdl import wait as pdl_wait
    from strata.engine.core.quant.gemv_dp4a import round_and_store
except ImportError:  # optional: the torch path needs neither
    triton = None

SILU_SUBS = 32  # x groups (of 32) per program of silu_mul_rounded, as quantize_x's


if triton is not None:

    @triton.jit
    def _silu_mul_round_kernel(gate_up_ptr, x_out_ptr, q_ptr, d_ptr, s_ptr, num_cols,
                               BLOCK_SUBS: tl.constexpr, GELU: tl.constexpr,
                               USE_PDL: tl.constexpr):
        pdl_wait(USE_PDL)  # gate_up comes from the kernel just before
        num_subs = num_cols // 32
        sub = tl.program_id(0) * BLOCK_SUBS + tl.arange(0, BLOCK_SUBS)
        cols = sub[:, None] * 32 + tl.arange(0, 32)[None, :]  # [S, 32]
        ok = (sub < num_subs)[:, None]
        gate = tl.load(gate_up_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(gate_up_ptr + num_cols + cols, mask=ok, other=0.0).to(tl.float32)
        if GELU:  # GeGLU's gelu_tanh(gate) * up
            x = (gelu_tanh(gate) * up).to(x_out_ptr.dtype.element_ty)
        else:
            x = (gate * tl.sigmoid(gate) * up).to(x_out_ptr.dtype.element_ty)
        tl.store(x_out_ptr + cols, x, mask=ok)
        round_and_store(x.to(tl.float32), sub, num_subs, q_ptr, d_ptr, s_ptr)


def add_rms_norm_rounded(h: torch.Tensor, y: torch.Tensor | None, weight: torch.Tensor,
                         eps: float, use_pdl: bool = False, unit_offset: bool = False,
                         y_norm: tuple[torch.Tensor, float] | None = None) -> tuple:
    """(h + y, x, (q, d, s)) for one token h, y [1, H] (y None: h itself): x = rms_norm(h + y)
    as decode_dense.add_rms_norm gives it, and (q, d, s) = gemv_dp4a.quantize_x(x), in one
    launch. H must be a multiple of 32. unit_offset: Gemma's norm (pointwise.rms_norm);
    y_norm: (weight, eps) of a norm applied to y first (decode_dense.add_rms_norm)."""
    hidden = weight.shape[0]
    if (h.shape != (1, hidden) or (y is not None and y.numel() != hidden)
            or hidden % X_GROUP):
        raise ValueError(f"add_rms_norm_rounded takes one token of {hidden} values (a multiple "
                         f"of {X_GROUP}) as [1, {hidden}], got {tuple(h.shape)} and "
                         f"{None if y is None else tuple(y.shape)}")
    return launch_add_rms_norm(h, y, weight, eps, use_pdl, empty_rounding(1, hidden, h.device),
                               unit_offset, y_norm)


def silu_mul_rounded(gate_up: torch.Tensor, use_pdl: bool = False, gelu: bool = False
                     ) -> tuple:
    """(x, (q, d, s)) for one token's gate_up [1, 2I] = [gate | up]: x = silu(gate) * up [1, I]
    (gelu: gelu_tanh(gate) * up) rounded once to gate_up's dtype, and (q, d, s) =
    gemv_dp4a.quantize_x(x), in one launch. I must be a multiple of 32."""
    if gate_up.dim() != 2 or gate_up.shape[0] != 1 or gate_up.shape[1] % (2 * X_GROUP):
        raise ValueError(f"silu_mul_rounded takes one token's [gate | up] of a multiple of "
                         f"{2 * X_GROUP} values, got {tuple(gate_up.shape)}")
    num_cols = gate_up.shape[1] // 2
    x = torch.empty(1, num_cols, dtype=gate_up.dtype, device=gate_up.device)
    rounded = empty_rounding(1, num_cols, x.device)
    _silu_mul_round_kernel[(triton.cdiv(num_cols // X_GROUP, SILU_SUBS),)](
        gate_up.contiguous(), x, *rounded, num_cols, BLOCK_SUBS=SILU_SUBS, GELU=gelu,
        **pdl.launch_options(use_pdl))
    return x, rounded


def check(model: torch.nn.Module, use_pdl: bool) -> str:
    """'' when both kernels match decode_dense.add_rms_norm, pointwise.silu_mul and
    gemv_dp4a.quantize_x for this model's hidden size and dtype on its device (or the model
    never takes them: float32, a hidden size not a multiple of 32); else why. Checked with
    decode_dense.check_kernels (kernel_checks.check): the decode step uses them where it uses
    the dense kernels."""
    from strata.engine.core.fast import decode_dense, pointwise
    from strata.engine.core.models.layers import GeGLU

    norm = model.model.layers[0].post_attention_layernorm
    offset = pointwise.is_unit_offset(norm)  # the variants this model takes (Gemma's)
    gelu = isinstance(model.model.layers[0].mlp, GeGLU)
    device, dtype = norm.weight.device, norm.weight.dtype
    hidden = norm.weight.shape[0]
    if dtype not in (torch.bfloat16, torch.float16) or hidden % X_GROUP:
        return ""
    gen = torch.Generator(device="cpu").manual_seed(1)
    h, y = (torch.randn(1, hidden, generator=gen).to(device, dtype) for _ in range(2))
    gate_up = torch.randn(1, 2 * hidden, generator=gen).to(device, dtype)

    def dequantized(rounded: tuple) -> torch.Tensor:
        q, d, _ = rounded
        return (q.float().view(1, -1, X_GROUP) * d[:, :, None]).view(1, -1)

    try:
        with torch.inference_mode():
            h_sum, x, rounded = add_rms_norm_rounded(h, y, norm.weight, norm.eps, use_pdl,
                                                     offset)
            act, act_rounded = silu_mul_rounded(gate_up, use_pdl, gelu)
            want_h, want_x = decode_dense.add_rms_norm(h, y, norm.weight, norm.eps,
                                                       unit_offset=offset)
            gate, up = gate_up.float().chunk(2, dim=-1)
            act_mul = pointwise.gelu_mul if gelu else pointwise.silu_mul
            want_act = act_mul(gate, up).to(dtype)
            got = [h_sum, x, dequantized(rounded), act, dequantized(act_rounded)]
            expected = [want_h, want_x, dequantized(quantize_x(want_x)), want_act,
                        dequantized(quantize_x(want_act))]
    except Exception as exc:  # noqa: BLE001 - any compile or launch error means: do not use
        return f"{type(exc).__name__}: {str(exc)[:200]}"
    names = ("norm residual", "norm", "norm's int8", "silu_mul", "silu_mul's int8")
    for name, a, b in zip(names, got, expected):
        scale = max(b.float().abs().max().item(), 1.0)
        error = (a.float() - b.float()).abs().max().item() / scale
        if not error <= 3e-2:
            return f"rounded {name} mismatch: relative error {error:.3g}"
    return ""
