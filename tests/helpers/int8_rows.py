"""The int8 rounding of rows per 32 values in torch (gemv_dp4a.round_groups' math), for the
tests of the kernels that multiply such rows (quant/expert_mmq.py)."""

from __future__ import annotations

import torch


def round_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q int8, d, s) of x [R, K]: per 32 values d = max |x| / 127, q = x * 127 / max to
    nearest (ties away from 0), s = d * sum(q)."""
    v = x.float().view(x.shape[0], -1, 32)
    amax = v.abs().amax(-1)
    inverse = torch.where(amax > 0, 127.0 / torch.where(amax > 0, amax, 1.0), 0.0)
    scaled = v * inverse[..., None]
    q = torch.trunc(scaled + torch.where(scaled >= 0, 0.5, -0.5)).clamp(-127, 127)
    d = amax / 127.0
    return q.to(torch.int8).view(x.shape), d, d * q.sum(-1)


def dequantized(rounded: tuple) -> torch.Tensor:
    """The float64 values d * q of a rounding (q, d, s)."""
    q, d, _ = rounded
    return (q.double().view(q.shape[0], -1, 32) * d.double()[..., None]).view(q.shape)
