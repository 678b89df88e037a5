"""Element-wise pieces of a decoder step, optionally fused by torch.compile.

Decoding one token is bound by the weight reads of the matrix-vector products; what else costs
time is the number of tiny kernels between them. Each function here is a group of element-wise
ops that Inductor fuses into one kernel. The eager versions are the numerical reference and
the fallback when compiling is off or fails.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The RMSNorm of models/layers.py: float32 statistics, rounded to x's dtype, then scaled."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm(
    h: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + y, rms_norm(h + y)): the residual add and the next block's norm in one pass."""
    h = h + y
    return h, rms_norm(h, weight, eps)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, D] by cos/sin [T, D] (HF layout: the two halves of D pair up)."""
    cos = cos[:, None, :].to(x.dtype)
    sin = sin[:, None, :].to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def norm_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weight: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """Optional per-head RMSNorm (Qwen3's q/k norm), then RoPE, on x [T, heads, D]."""
    if weight is not None:
        x = rms_norm(x, weight, eps)
    return rope(x, cos, sin)


def masked_softmax(
    scores: torch.Tensor, key_positions: torch.Tensor, position: torch.Tensor, scale: float
) -> torch.Tensor:
    """softmax(scale * scores) over keys at or before `position`; float32 math, scores' dtype out.

    scores [Hkv, G, S]; key_positions [S] (0..S-1); position [1]: the query's position.
    """
    logits = scores.float() * scale
    logits = logits.masked_fill(key_positions > position, float("-inf"))
    return torch.softmax(logits, dim=-1).to(scores.dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up: the SwiGLU activation."""
    return F.silu(gate) * up


@dataclass
class PointwiseOps:
    """The element-wise groups a decode step calls; compiled or eager, same signatures."""

    rms_norm: Callable = rms_norm
    add_rms_norm: Callable = add_rms_norm
    norm_rope: Callable = norm_rope
    masked_softmax: Callable = masked_softmax
    silu_mul: Callable = silu_mul
    is_compiled: bool = False
    # Decode attention by the two Triton kernels of decode_attention.py (checked per decoder).
    fused_attention: bool = False


EAGER_OPS = PointwiseOps()


def compiled_ops() -> PointwiseOps:
    """PointwiseOps fused by torch.compile (static shapes; one compile per shape, cached).

    Compiling happens on first call, so the caller must warm up before CUDA-graph capture.
    """

    def compile_one(fn: Callable) -> Callable:
        # dynamic=False: decode shapes are fixed per model and bucket; no guards on sizes.
        return torch.compile(fn, dynamic=False, fullgraph=True)

    return PointwiseOps(
        rms_norm=compile_one(rms_norm),
        add_rms_norm=compile_one(add_rms_norm),
        norm_rope=compile_one(norm_rope),
        masked_softmax=compile_one(masked_softmax),
        silu_mul=compile_one(silu_mul),
        is_compiled=True,
    )
