"""GLM-4.5's shared expert in the fast MoE paths: a dense SwiGLU on every token, added to the
routed experts' sum (models/switch.py adds it in SparseMoE.forward).

Its own module because the MoE paths cannot import forward.py's dense feed-forward (forward.py
imports them); the products are fast/linear.py's, over the fused gate/up view where the weights
arena holds gate and up back to back.
"""

from __future__ import annotations

import torch

from strata.engine.core.fast.linear import linear
from strata.engine.core.fast.pointwise import EAGER_OPS, PointwiseOps
from strata.engine.core.fused_views import fused_gate_up


def shared_expert(mlp, x: torch.Tensor, ops: PointwiseOps = EAGER_OPS) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)) of the shared expert `mlp` (a SwiGLU) for x [T, H]."""
    gate_up = fused_gate_up(mlp)
    if gate_up is not None:
        gate, up = linear(x, gate_up, None, ops).chunk(2, dim=-1)  # two [T, I] views
    else:
        gate = linear(x, mlp.gate_proj.weight, None, ops)
        up = linear(x, mlp.up_proj.weight, None, ops)
    return linear(ops.silu_mul(gate, up), mlp.down_proj.weight, None, ops)
