"""Element-wise pieces of a decoder step or prefill chunk, optionally fused by torch.compile.

Decoding one token is bound by the weight reads of the matrix-vector products; what else costs
time is the number of tiny kernels between them. A prefill chunk's GEMMs are large, but eagerly
its norms, RoPE and MoE gathers are thousands of small kernels per chunk, a large share of its
time (docs/benchmarks.md, "Figures behind the fast path"). Each function here is a group of
element-wise ops that
Inductor fuses into one kernel. The eager versions are the numerical reference and the
fallback when compiling is off or fails.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from strata.engine.core.models.layers import GeGLU, GemmaRMSNorm


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             unit_offset: bool = False) -> torch.Tensor:
    """The RMSNorm of models/layers.py: float32 statistics, rounded to x's dtype, then scaled.
    unit_offset: Gemma's (GemmaRMSNorm), scaled by 1 + weight in float32, then rounded."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if unit_offset:
        return (x32 * (1.0 + weight.float())).to(x.dtype)
    return weight * x32.to(x.dtype)


def add_rms_norm(
    h: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float,
    unit_offset: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + y, rms_norm(h + y)): the residual add and the next block's norm in one pass."""
    h = h + y
    return h, rms_norm(h, weight, eps, unit_offset)


def is_unit_offset(norm) -> bool:
    """Whether a norm module scales by 1 + weight (Gemma's), as rms_norm's unit_offset."""
    return isinstance(norm, GemmaRMSNorm)


def apply_norm(ops: PointwiseOps, x: torch.Tensor, norm) -> torch.Tensor:
    """ops.rms_norm by a norm module's weight, eps and kind."""
    if is_unit_offset(norm):
        return ops.rms_norm(x, norm.weight, norm.eps, True)
    return ops.rms_norm(x, norm.weight, norm.eps)


def apply_add_norm(ops: PointwiseOps, h: torch.Tensor, y: torch.Tensor | None, norm
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + y, norm(h + y)) by ops.add_rms_norm; y None: (h, norm(h))."""
    if y is None:
        return h, apply_norm(ops, h, norm)
    if is_unit_offset(norm):
        return ops.add_rms_norm(h, y, norm.weight, norm.eps, True)
    return ops.add_rms_norm(h, y, norm.weight, norm.eps)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, D] by cos/sin [T, D] (HF layout: the two halves of D pair up)."""
    cos = cos[:, None, :].to(x.dtype)
    sin = sin[:, None, :].to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def norm_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weight: torch.Tensor | None, eps: float,
    unit_offset: bool = False,
) -> torch.Tensor:
    """Optional per-head RMSNorm (Qwen3's and Gemma's q/k norm), then RoPE, on x [T, heads, D]."""
    if weight is not None:
        x = rms_norm(x, weight, eps, unit_offset)
    return rope(x, cos, sin)


def qk_norm_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
    unit_offset: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """norm_rope of the queries and of the keys: one compiled call for both."""
    return (norm_rope(q, cos, sin, q_weight, eps, unit_offset),
            norm_rope(k, cos, sin, k_weight, eps, unit_offset))


def attn_qk_norm_rope(attn, q, k, cos, sin, ops: PointwiseOps):
    """ops.qk_norm_rope with the attention module's q/k norms (Qwen3, Gemma), if it has them."""
    if attn.q_norm is None:
        return ops.qk_norm_rope(q, k, cos, sin, None, None, 0.0)
    if is_unit_offset(attn.q_norm):
        return ops.qk_norm_rope(q, k, cos, sin, attn.q_norm.weight, attn.k_norm.weight,
                                attn.q_norm.eps, True)
    return ops.qk_norm_rope(q, k, cos, sin, attn.q_norm.weight, attn.k_norm.weight,
                            attn.q_norm.eps)


def attention_scale(attn) -> float:
    """The scores' factor: the layer's own (Gemma's query_pre_attn_scalar) or 1/sqrt(D).
    Read with defaults: a layer may be any object with the shape fields (tests' stand-ins)."""
    scale = getattr(attn, "scale", None)
    return scale if scale is not None else attn.head_dim**-0.5


def attention_window(attn) -> int:
    """The layer's sliding window in positions, 0 where it sees every cached position."""
    return getattr(attn, "sliding_window", None) or 0


def attention_sinks(attn) -> torch.Tensor | None:
    """GPT-OSS's per-head sink logits [Hq], or None."""
    return getattr(attn, "sinks", None)


def masked_softmax(
    scores: torch.Tensor, key_positions: torch.Tensor, position: torch.Tensor, scale: float,
    window: int = 0, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(scale * scores) over keys at or before `position`; float32 math, scores' dtype out.

    scores [Hkv, G, S]; key_positions [S] (0..S-1); position [1]: the query's position.
    window > 0: only keys after position - window count. sinks [Hkv * G]: each head's logit
    that joins the denominator and attends to nothing (GPT-OSS).
    """
    logits = scores.float() * scale
    hidden = key_positions > position
    if window:
        hidden = hidden | (key_positions <= position - window)
    logits = logits.masked_fill(hidden, float("-inf"))
    if sinks is None:
        return torch.softmax(logits, dim=-1).to(scores.dtype)
    sink = sinks.float().view(logits.shape[0], logits.shape[1], 1)
    probs = torch.softmax(torch.cat((logits, sink), dim=-1), dim=-1)[..., :-1]
    return probs.to(scores.dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up: the SwiGLU activation."""
    return F.silu(gate) * up


def gelu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up: the GeGLU activation (Gemma)."""
    return F.gelu(gate, approximate="tanh") * up


def gate_mul(ops: PointwiseOps, mlp, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """A dense gated MLP's activation: GeGLU's gelu_mul, else SwiGLU's silu_mul."""
    return ops.gelu_mul(gate, up) if isinstance(mlp, GeGLU) else ops.silu_mul(gate, up)


def silu_mul_scale(gate: torch.Tensor, up: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up * scale[:, None]: an expert row's activation times its routing weight."""
    return F.silu(gate) * up * scale[:, None]


def sum_rows(rows: torch.Tensor, index: torch.Tensor, group: int) -> torch.Tensor:
    """out[t] = sum of rows[index[t * group + j]] over j, in float32, rounded to rows' dtype.

    rows [R, H], index [R]: gathers each token's `group` expert rows and adds them up.
    Written as `group` gathers added in turn, not a gather then a sum over a middle axis:
    compiled, that is one element-wise kernel; the reduction form compiled to a kernel far
    slower than the two eager ones (docs/benchmarks.md, "Figures behind the fast path").
    """
    index = index.view(-1, group)  # [T, group]
    total = rows.index_select(0, index[:, 0]).float()
    for j in range(1, group):
        total = total + rows.index_select(0, index[:, j]).float()
    return total.to(rows.dtype)


@dataclass
class PointwiseOps:
    """The element-wise groups a decode step or prefill chunk calls; compiled or eager, same
    signatures."""

    rms_norm: Callable = rms_norm
    add_rms_norm: Callable = add_rms_norm
    qk_norm_rope: Callable = qk_norm_rope
    masked_softmax: Callable = masked_softmax
    silu_mul: Callable = silu_mul
    gelu_mul: Callable = gelu_mul
    silu_mul_scale: Callable = silu_mul_scale
    sum_rows: Callable = sum_rows
    # A whole MoE block for many tokens (moe_prefill.grouped_block), compiled: not element-wise,
    # but each compiled call costs many eager ops' host time, and a prefill chunk of a MoE model
    # is bound by host time once its GEMMs are grouped. None: the eager sorted path.
    moe_block: Callable | None = None
    # The quantized experts' dequantize-then-grouped path (expert_grouped.experts_mlp's
    # signature) replayed per layer from CUDA graphs (expert_graphs.py): its ~130 launches a
    # layer cost the host more than the GPU. None: called.
    grouped_experts: Callable | None = None
    is_compiled: bool = False
    # Decode attention by the two Triton kernels of decode_attention.py (checked per decoder).
    fused_attention: bool = False
    # One token's small projections and norms by the Triton kernels of decode_dense.py
    # (checked per decoder), and every Triton kernel of a decode step chained by PDL (pdl.py).
    dense_kernels: bool = False
    pdl: bool = False
    # With dense_kernels: a norm and SiLU·mul run in the prologue of the GEMV after them
    # (decode_dense.norm_gemv, silu_mul_gemv). Off only to measure what that gives.
    gemv_prologues: bool = True


EAGER_OPS = PointwiseOps()
