"""GLM-4.5's shared expert in the fast MoE paths: a dense SwiGLU on every token, added to the
routed experts' sum (models/switch.py adds it in SparseMoE.forward).

Its own module because the MoE paths cannot import forward.py's dense feed-forward (forward.py
imports them); the products are the same ones: the fused gate/up view where the weights arena
holds gate and up back to back, GGML blocks by qlinear, one token by decode_dense's GEMV where
the decode's dense kernels are on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from strata.engine.core.fast import decode_dense
from strata.engine.core.fast.pointwise import EAGER_OPS, PointwiseOps
from strata.engine.core.fused_views import fused_gate_up
from strata.engine.core.quant import weight as qweight


def _linear(x: torch.Tensor, weight, ops: PointwiseOps) -> torch.Tensor:
    if isinstance(weight, qweight.QuantizedWeight):
        return qweight.qlinear(x, weight, None, use_pdl=ops.pdl)
    if ops.dense_kernels and x.shape[0] == 1 and decode_dense.use_gemv(weight):
        return decode_dense.gemv(x, weight, None, use_pdl=ops.pdl)
    return F.linear(x, weight)


def shared_expert(mlp, x: torch.Tensor, ops: PointwiseOps = EAGER_OPS) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)) of the shared expert `mlp` (a SwiGLU) for x [T, H]."""
    gate_up = fused_gate_up(mlp)
    if gate_up is not None:
        gate, up = _linear(x, gate_up, ops).chunk(2, dim=-1)  # two [T, I] views
    else:
        gate, up = _linear(x, mlp.gate_proj.weight, ops), _linear(x, mlp.up_proj.weight, ops)
    return _linear(ops.silu_mul(gate, up), mlp.down_proj.weight, ops)
