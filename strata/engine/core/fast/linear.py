"""One product of the fast paths, whatever form its weight takes: GGML blocks by qlinear, one
token by decode_dense's GEMV where the decode's dense kernels are on, else F.linear. Its own
module so that the MoE paths (the shared expert) use it too: they cannot import forward.py,
which imports them."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from strata.engine.core.fast import decode_dense
from strata.engine.core.fast.pointwise import EAGER_OPS, PointwiseOps
from strata.engine.core.quant import weight as qweight


def linear(x: torch.Tensor, weight, bias: torch.Tensor | None,
           ops: PointwiseOps = EAGER_OPS, rounded: tuple | None = None) -> torch.Tensor:
    """F.linear, or for one token with ops.dense_kernels and a small weight, decode_dense.gemv;
    a weight held as GGML blocks takes its own branch, qlinear (quant/weight.py), its one-token
    kernels launched as PDL secondaries where ops.pdl says the dense ones are, reading
    `rounded` (x's int8 rounding made with x) if given."""
    if isinstance(weight, qweight.QuantizedWeight):
        return qweight.qlinear(x, weight, bias, use_pdl=ops.pdl, rounded=rounded)
    if ops.dense_kernels and x.shape[0] == 1 and decode_dense.use_gemv(weight):
        return decode_dense.gemv(x, weight, bias, use_pdl=ops.pdl)
    return F.linear(x, weight, bias)
