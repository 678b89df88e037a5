"""What a MoE layer's experts add to the plain SwiGLU, as the fast expert paths take it:
GPT-OSS's per-expert biases (gate, up, down) and its clamped SwiGLU (models/switch.py,
ExpertActivation).

An `Epilogue` exists only for such layers (`of` returns None for plain experts), so Qwen3-MoE
and Mixtral launch the same kernel variants as before: its fields become the kernels'
constexprs (HAS_BIAS, CLAMP, LIMIT, ALPHA) and three bias pointers. The biases are indexed
by expert id, not by a cache slot: they stay resident beside the router while the expert
cache moves the three matrices (release, refill, shrink and the slot table leave them be).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class Epilogue:
    """Biases gate/up [E, I] and down [E, H] (None: no biases), and the clamp limit (None:
    plain SiLU) with its sigmoid's alpha."""

    gate_bias: torch.Tensor | None
    up_bias: torch.Tensor | None
    down_bias: torch.Tensor | None
    limit: float | None
    alpha: float

    def constexprs(self) -> dict:
        """The expert kernels' compile-time switches for this epilogue."""
        return {"HAS_BIAS": self.gate_bias is not None, "CLAMP": self.limit is not None,
                "LIMIT": float(self.limit or 0.0), "ALPHA": float(self.alpha)}

    def bias_pointers(self, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(gate, up, down) bias tensors to pass a kernel (`ids` stands in where there are
        none: never read)."""
        if self.gate_bias is None:
            return ids, ids, ids
        return self.gate_bias, self.up_bias, self.down_bias  # type: ignore[return-value]

    def activate(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """The gated activation of biased gate and up rows, as ExpertActivation computes it."""
        if self.limit is None:
            return torch.nn.functional.silu(gate) * up
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return gate * torch.sigmoid(gate * self.alpha) * (up + 1)


PLAIN = {"HAS_BIAS": False, "CLAMP": False, "LIMIT": 0.0, "ALPHA": 1.0}  # plain SwiGLU


def of(moe) -> Epilogue | None:
    """The layer's epilogue, or None where its experts are plain SwiGLU (moe.plain_experts)."""
    if moe.plain_experts:
        return None
    bias = moe.expert_bias
    return Epilogue(
        bias.gate if bias is not None else None, bias.up if bias is not None else None,
        bias.down if bias is not None else None, moe.activation.limit, moe.activation.alpha)


def kernel_args(epilogue: Epilogue | None, ids: torch.Tensor,
                bias_ids: torch.Tensor | None = None) -> tuple[tuple, dict]:
    """((bias ids, gate bias, up bias, down bias), constexprs) for an expert kernel:
    bias_ids are the routed experts' real ids (default `ids`; they differ where the kernel
    reads dequantized copies by local ids 0..k-1)."""
    if epilogue is None:
        return (ids, ids, ids, ids), PLAIN
    bias_ids = ids if bias_ids is None else bias_ids
    return (bias_ids.contiguous(), *epilogue.bias_pointers(ids)), epilogue.constexprs()


def row_biases(epilogue: Epilogue, row_experts: torch.Tensor):
    """(gate [R, I], up [R, I], down [R, H]) biases of rows routed to row_experts [R], or
    Nones: for the torch paths, which add them to whole rows."""
    if epilogue.gate_bias is None:
        return None, None, None
    return tuple(b.index_select(0, row_experts)  # type: ignore[union-attr]
                 for b in (epilogue.gate_bias, epilogue.up_bias, epilogue.down_bias))
