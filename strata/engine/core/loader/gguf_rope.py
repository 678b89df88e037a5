"""RoPE scaling from GGUF metadata, as a Hugging Face `rope_scaling` dict.

Linear and YaRN scaling are plain metadata keys. Llama 3's scaling is not: llama.cpp's
converter bakes it into a `rope_freqs.weight` tensor of per-frequency divisors, so the HF
parameters are recovered here by fitting that tensor.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

# Llama 3's pre-training context. Any value gives the same frequencies once low/high are fitted
# against it (only low/orig and high/orig matter); this one recovers the published 1 and 4.
_LLAMA3_ORIGINAL_CONTEXT_TOKENS = 8192


def rope_scaling_from_metadata(meta: dict[str, Any]) -> dict[str, Any] | None:
    """HF rope_scaling from `{arch}.rope.scaling.*` values (keys without the arch prefix)."""
    kind = meta.get("rope.scaling.type")
    factor = meta.get("rope.scaling.factor")
    if kind in (None, "none") or not factor or factor == 1.0:
        return None
    scaling: dict[str, Any] = {"rope_type": kind, "factor": float(factor)}
    original = meta.get("rope.scaling.original_context_length")
    if original:
        scaling["original_max_position_embeddings"] = int(original)
    if kind == "yarn":
        for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if meta.get(f"rope.scaling.{key}") is not None:
                scaling[name] = float(meta[f"rope.scaling.{key}"])
        log_mul = meta.get("rope.scaling.yarn_log_multiplier")
        if log_mul:  # HF's mscale_all_dim; llama.cpp takes mscale as 1 (llama-context.cpp)
            scaling.update(mscale=1.0, mscale_all_dim=float(log_mul))
    return scaling


def llama3_scaling_from_freqs(
    rope_freqs: np.ndarray, rope_theta: float, head_dim: int
) -> dict[str, Any] | None:
    """Recover HF llama3 rope_scaling {factor, low/high_freq_factor, original_max...}.

    The converter writes f_i = 1 / ((1 - s_i) / factor + s_i), where, with u_i = 1/wavelen_i,
    s_i = (u_i - u_lo) / (u_hi - u_lo) clamped to [0, 1], u_lo = low/orig, u_hi = high/orig.
    Two or more unclamped points fit that line exactly; with fewer, any u_lo/u_hi that
    classify every frequency the same way give the same frequencies, so one is picked.
    """
    freqs = np.asarray(rope_freqs, dtype=np.float64).reshape(-1)
    factor = float(freqs.max())
    if factor <= 1.0 + 1e-6:
        return None
    u = rope_theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim) / (2 * math.pi)
    if u.shape != freqs.shape:
        raise ValueError(f"rope_freqs has {freqs.size} values, expected {u.size}")
    tol = 1e-4 * factor
    is_kept, is_slowed = freqs <= 1.0 + tol, freqs >= factor - tol
    band = ~is_kept & ~is_slowed
    s = (1.0 / freqs - 1.0 / factor) / (1.0 - 1.0 / factor)
    if band.sum() >= 2:
        slope, intercept = np.polyfit(u[band], s[band], 1)
        u_lo = -intercept / slope
        u_hi = u_lo + 1.0 / slope
    else:
        below = u[is_slowed].max()  # u_lo lies above every slowed frequency...
        above = u[is_kept].min() if is_kept.any() else 2.0 * u.max()  # ...u_hi below kept ones
        if band.any():
            u_b, s_b = float(u[band][0]), float(s[band][0])
            width = 0.5 * min(u_b - below, above - u_b)
            u_lo, u_hi = u_b - s_b * width, u_b + (1.0 - s_b) * width
        else:
            u_lo, u_hi = below + (above - below) / 3, below + 2 * (above - below) / 3
    orig = _LLAMA3_ORIGINAL_CONTEXT_TOKENS
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": round(float(u_lo * orig), 6),
        "high_freq_factor": round(float(u_hi * orig), 6),
        "original_max_position_embeddings": orig,
    }


def llama3_freqs(scaling: dict[str, Any], rope_theta: float, head_dim: int) -> np.ndarray:
    """The `rope_freqs` divisors llama.cpp's converter writes for an HF llama3 rope_scaling."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    orig = scaling["original_max_position_embeddings"]
    inv_freq = rope_theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2.0 * math.pi / inv_freq
    smooth = np.clip((orig / wavelen - low) / (high - low), 0.0, 1.0)
    return (1.0 / ((1.0 - smooth) / factor + smooth)).astype(np.float32)
