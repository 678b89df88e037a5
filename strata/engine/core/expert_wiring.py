"""Which of a model's parameters are its wired expert stacks (an all-resident load makes them
views of the expert slots), and taking them out when a live shrink moves the layers onto the
slot table (residency.py)."""

from __future__ import annotations

import torch

from strata.engine.core.models.switch import SparseMoE

_PROJS = ("gate_proj", "up_proj", "down_proj")


def expert_names(model: torch.nn.Module) -> dict[int, tuple[str, str, str]]:
    """layer -> parameter names of its stacked gate, up and down experts (sparse layers only)."""
    return {
        i: tuple(f"model.layers.{i}.mlp.experts.{p}" for p in _PROJS)  # type: ignore[misc]
        for i, layer in enumerate(model.model.layers)
        if isinstance(layer.mlp, SparseMoE)
    }


def unwire(experts: torch.nn.Module) -> None:
    """Meta placeholders in place of a layer's wired expert stacks (views of slots, or their
    QuantizedExperts), as a load into a partial cache leaves them: after a shrink those slots
    may be unmapped, and a stale reader then fails on the host instead of faulting the GPU."""
    for name in _PROJS:
        shape = tuple(getattr(experts, name).shape)
        if name in experts._parameters:
            del experts._parameters[name]
        else:
            delattr(experts, name)
        experts.register_parameter(
            name, torch.nn.Parameter(torch.empty(shape, device="meta"), requires_grad=False))
