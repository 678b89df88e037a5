"""Mixture-of-experts dispatch, shared by Qwen3-MoE and Mixtral; where the expert cache plugs in.

Expert weights are stacked per layer: gate/up [E, I, H], down [E, H, I]. The layer asks an
`ExpertWeights` provider for the experts a call needs; the default one indexes the stacked
parameters, an expert cache can supply views into its own slots instead. Quantized experts
(quant/experts.py) replace the three parameters; indexing them dequantizes one expert.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from strata.engine.core.loader.lazy import LazyTensor, StackedTensor, narrowed
from strata.engine.core.model_config import ModelFormatError
from strata.engine.core.quant.experts import ExpertMatrices, QuantizedExperts

if TYPE_CHECKING:
    from strata.engine.core.models.forced_routing import ForcedLayer

# Per kind (gate, up, down), the requested experts in request order: position j holds the
# j-th id's matrix. A stacked tensor [k, ...] and a list of k views both qualify.
ExpertBatch = tuple[Sequence[torch.Tensor], Sequence[torch.Tensor], Sequence[torch.Tensor]]


class ExpertWeights(Protocol):
    def get(self, expert_ids: Sequence[int]) -> ExpertBatch:
        """(gate, up, down) for the ids: gate[j], up[j] [I, H] and down[j] [H, I] for ids[j].

        All ids of one call come together so a cache can bring missing experts in one batch
        (ExpertStore.fetch(layer, ids) already has this shape).
        """


@dataclass(frozen=True)
class SlotLayout:
    """One layer's experts in a partial expert cache, as decode kernels read them by id
    without asking the host (fast/moe_triton.py); a provider that can offer this has it as
    its `layout` attribute.

    gate/up [N, I, H] and down [N, H, I] are the cache's slots (shared by every layer); table
    [E] int32 holds expert e's slot, or -1: then expert e is read in place from the host
    copy, whose [E, ...] tensors start host_offsets (gate, up, down) elements past the slot
    weights' bases. The router writes the step's ids into step_ids [rows, k] for the cache
    (row b of a batch step in row b; one token in row 0).
    Quantized experts: gate/up/down are QuantizedExperts over the slots, offsets in bytes."""

    gate: torch.Tensor | QuantizedExperts
    up: torch.Tensor | QuantizedExperts
    down: torch.Tensor | QuantizedExperts
    table: torch.Tensor
    host_offsets: tuple[int, int, int]
    step_ids: torch.Tensor


class StackedExperts(nn.Module):
    """The stacked expert parameters of one layer, and the default ExpertWeights provider."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.up_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def get(self, expert_ids: Sequence[int]) -> ExpertBatch:
        if isinstance(self.gate_proj, QuantizedExperts):  # dequantized one at a time, on use
            return tuple(ExpertMatrices(w, expert_ids)  # type: ignore[return-value]
                         for w in (self.gate_proj, self.up_proj, self.down_proj))
        # Lists of views rather than index_select: no copy of the expert weights per call.
        return (
            [self.gate_proj[e] for e in expert_ids],
            [self.up_proj[e] for e in expert_ids],
            [self.down_proj[e] for e in expert_ids],
        )


class SparseMoE(nn.Module):
    """Router softmax -> top-k -> optional renormalisation -> per-expert SwiGLU, weighted sum."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        num_experts_per_tok: int,
        norm_topk_prob: bool,
    ):
        super().__init__()
        if not 0 < num_experts_per_tok <= num_experts:
            raise ModelFormatError(
                f"num_experts_per_tok {num_experts_per_tok} must be in 1..{num_experts}: "
                "the config is inconsistent"
            )
        self.router = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = StackedExperts(num_experts, hidden_size, intermediate_size)
        self.top_k = num_experts_per_tok
        self.norm_topk_prob = norm_topk_prob
        # Replaced by the expert cache; None means the stacked parameters above.
        self.expert_weights: ExpertWeights | None = None
        # Benchmarks only (forced_routing.py): a trace's ids in place of the top-k.
        self.forced: ForcedLayer | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = F.softmax(self.router(x).float(), dim=-1)  # [T, E]
        if self.forced is None:
            top_probs, top_ids = torch.topk(probs, self.top_k, dim=-1)  # [T, k]
        else:
            top_ids = self.forced.rows(x.shape[0])  # [T, k]
            top_probs = probs.gather(-1, top_ids)  # [T, k]
        if self.norm_topk_prob:
            top_probs = top_probs / top_probs.sum(dim=-1, keepdim=True)
        top_probs = top_probs.to(x.dtype)
        # One host sync per layer to learn which experts run; fine for batch-1 decoding.
        expert_ids = torch.unique(top_ids).tolist()
        provider = self.experts if self.expert_weights is None else self.expert_weights
        out = torch.zeros_like(x)  # [T, H]
        gates, ups, downs = provider.get(expert_ids)
        for j, expert_id in enumerate(expert_ids):
            token_idx, slot_idx = torch.where(top_ids == expert_id)  # [n], [n]
            h = x[token_idx]  # [n, H]
            y = F.linear(F.silu(F.linear(h, gates[j])) * F.linear(h, ups[j]), downs[j])  # [n, H]
            out.index_add_(0, token_idx, y * top_probs[token_idx, slot_idx, None])
        return out


_PER_EXPERT = re.compile(
    r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$"
)
_FUSED_GATE_UP = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.gate_up_proj$")


def stack_experts(tensors: dict[str, LazyTensor], num_experts: int) -> dict[str, LazyTensor]:
    """Turn per-expert `mlp.experts.{e}.{gate,up,down}_proj.weight` tensors into stacked ones.

    Also splits the fused `mlp.experts.gate_up_proj` [E, 2I, H] of transformers 5 (gate first).
    Works on unread tensors (loader/lazy.py): nothing is read or stacked until the load copies
    a layer's experts into place.
    """
    groups: dict[tuple[str, str], dict[int, LazyTensor]] = {}
    for name in list(tensors):
        match = _PER_EXPERT.match(name)
        if match:
            prefix, expert, proj = match.groups()
            groups.setdefault((prefix, proj), {})[int(expert)] = tensors.pop(name)
            continue
        match = _FUSED_GATE_UP.match(name)
        if match:
            fused = tensors.pop(name)  # [E, 2I, H]
            half = fused.shape[1] // 2
            tensors[f"{match.group(1)}.gate_proj"] = narrowed(fused, 1, 0, half)
            tensors[f"{match.group(1)}.up_proj"] = narrowed(fused, 1, half, half)
    for (prefix, proj), by_id in groups.items():
        for expert in range(num_experts):
            if expert not in by_id:
                raise ModelFormatError(
                    f"missing tensor {prefix}.{expert}.{proj}_proj.weight: the file is "
                    "incomplete or its config.json does not match"
                )
        for expert in by_id:
            if expert >= num_experts:
                raise ModelFormatError(
                    f"unexpected tensor {prefix}.{expert}.{proj}_proj.weight: the config has "
                    f"{num_experts} experts; the file and its config.json do not match"
                )
        shapes = {tuple(t.shape) for t in by_id.values()}
        if len(shapes) != 1:
            raise ModelFormatError(
                f"experts of {prefix} {proj}_proj have different shapes {sorted(shapes)}: "
                "the file is damaged"
            )
        tensors[f"{prefix}.{proj}_proj"] = StackedTensor([by_id[e] for e in range(num_experts)])
    return tensors


def rename(tensors: dict[str, LazyTensor], rules: Sequence[tuple[str, str]]) -> dict:
    """Apply regex (pattern, replacement) rules to every tensor name in place, first match wins."""
    compiled = [(re.compile(p), r) for p, r in rules]
    for name in list(tensors):
        for pattern, replacement in compiled:
            new_name, count = pattern.subn(replacement, name)
            if count:
                if new_name in tensors:
                    raise ModelFormatError(
                        f"tensors {name} and {new_name} both exist: the file mixes two layouts"
                    )
                tensors[new_name] = tensors.pop(name)
                break
    return tensors
