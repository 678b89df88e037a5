"""Mixture-of-experts dispatch, shared by Qwen3-MoE, Mixtral, GLM-4.5 and GPT-OSS; where the
expert cache plugs in.

Routing is softmax top-k (Qwen3-MoE, Mixtral), softmax over the top-k logits with a router
bias (GPT-OSS), or sigmoid top-k whose choice adds a score-correction bias, optionally within
the best groups of experts (GLM-4.5, DeepSeek-V3's scheme); a shared expert, when the model
has one, runs on every token beside the routed ones; GPT-OSS's experts add biases and clamp
their SwiGLU.

Expert weights are stacked per layer: gate/up [E, I, H], down [E, H, I]. The layer asks an
`ExpertWeights` provider for the experts a call needs; the default one indexes the stacked
parameters, an expert cache can supply views into its own slots instead. Quantized experts
(quant/experts.py) replace the three parameters; indexing them dequantizes one expert.

GPT-OSS adds per-expert biases (ExpertBiases: small, always resident beside the router, so the
expert cache keeps moving the three matrices only), a router bias, softmax over the top-k
logits, and its clamped SwiGLU (`ExpertActivation`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from strata.engine.core.loader.lazy import LazyTensor, StackedTensor, narrowed
from strata.engine.core.model_config import ModelFormatError
from strata.engine.core.models.layers import SwiGLU
from strata.engine.core.quant.experts import ExpertMatrices, QuantizedExperts
from strata.engine.core.quant.weight import apply_linear

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
    Quantized experts: gate/up/down are QuantizedExperts over the slots, offsets in bytes.
    cpu_misses: the layer's LayerCpuMisses (fast/moe_cpu_misses.py) where one token's misses
    are computed on the CPU instead of read in place; None: read in place."""

    gate: torch.Tensor | QuantizedExperts
    up: torch.Tensor | QuantizedExperts
    down: torch.Tensor | QuantizedExperts
    table: torch.Tensor
    host_offsets: tuple[int, int, int]
    step_ids: torch.Tensor
    cpu_misses: Any = None


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


@dataclass(frozen=True)
class Routing:
    """How router logits become each token's experts and their weights.

    softmax: top-k of the softmax. sigmoid: top-k of sigmoid + e_score_correction_bias (the
    bias only chooses; the weights are the unbiased sigmoid scores), taken within the
    topk_group best of n_group groups (a group scores its two best). Then the top-k weights
    are renormalised (norm_topk_prob) and multiplied by scaling (routed_scaling_factor)."""

    scoring: str = "softmax"  # softmax | sigmoid
    scaling: float = 1.0
    n_group: int = 1
    topk_group: int = 1


class ExpertBiases(nn.Module):
    """Per-expert biases of gate/up [E, I] and down [E, H] (GPT-OSS)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate = nn.Parameter(torch.empty(num_experts, intermediate_size))
        self.up = nn.Parameter(torch.empty(num_experts, intermediate_size))
        self.down = nn.Parameter(torch.empty(num_experts, hidden_size))


@dataclass(frozen=True)
class ExpertActivation:
    """How an expert joins its gate and up projections. Plain: silu(gate) * up. Clamped
    (GPT-OSS): gate clamped above and up on both sides at `limit`, then
    gate * sigmoid(alpha * gate) * (up + 1)."""

    limit: float | None = None
    alpha: float = 1.0

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.limit is None:
            return F.silu(gate) * up
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return gate * torch.sigmoid(gate * self.alpha) * (up + 1)


SILU = ExpertActivation()


class SparseMoE(nn.Module):
    """Router -> top-k -> weights -> per-expert gated MLP, weighted sum; plus the shared
    expert's SwiGLU where shared_intermediate_size is set.

    Weights: softmax over all experts, then top-k, renormalised if norm_topk_prob (Qwen3-MoE,
    Mixtral); with softmax_after_topk, softmax over the k chosen logits (GPT-OSS); or the
    sigmoid scores of `routing` (GLM-4.5)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        num_experts_per_tok: int,
        norm_topk_prob: bool,
        routing: Routing = Routing(),
        shared_intermediate_size: int = 0,
        router_bias: bool = False,
        expert_bias: bool = False,
        softmax_after_topk: bool = False,
        activation: ExpertActivation = SILU,
    ):
        super().__init__()
        if not 0 < num_experts_per_tok <= num_experts:
            raise ModelFormatError(
                f"num_experts_per_tok {num_experts_per_tok} must be in 1..{num_experts}: "
                "the config is inconsistent"
            )
        self.router = nn.Linear(hidden_size, num_experts, bias=router_bias)
        self.experts = StackedExperts(num_experts, hidden_size, intermediate_size)
        self.expert_bias = (ExpertBiases(num_experts, hidden_size, intermediate_size)
                            if expert_bias else None)
        self.top_k = num_experts_per_tok
        self.norm_topk_prob = norm_topk_prob
        self.routing = routing
        # Sigmoid routing's selection bias [E] (HF: mlp.gate.e_score_correction_bias).
        self.e_score_correction_bias = (
            nn.Parameter(torch.zeros(num_experts)) if routing.scoring == "sigmoid" else None
        )
        self.shared_experts = (
            SwiGLU(hidden_size, shared_intermediate_size) if shared_intermediate_size else None
        )
        self.softmax_after_topk = softmax_after_topk
        self.activation = activation
        # Replaced by the expert cache; None means the stacked parameters above.
        self.expert_weights: ExpertWeights | None = None
        # Benchmarks only (forced_routing.py): a trace's ids in place of the top-k.
        self.forced: Any = None  # a forced_routing.ForcedLayer (it imports this module)
        # Fixed at build, so the fast paths choose their kernels once (fast/moe_grouped.py):
        # softmax top-k over an unbiased router (Qwen3-MoE, Mixtral) is what the Triton
        # routers compute; plain SwiGLU experts without biases are what every expert kernel
        # computes. GLM-4.5 routes otherwise, GPT-OSS does both otherwise.
        self.softmax_routing = (routing == Routing() and not router_bias
                                and not softmax_after_topk)
        self.plain_experts = not expert_bias and activation == SILU

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in x's dtype, expert ids [T, k]) for x [T, H]: the ids the routing
        chooses, or a benchmark's forced ids (forced_routing.py), weighted as the routing
        weights its own choice."""
        logits = self.router(x).float()  # [T, E]
        forced = self.forced.rows(x.shape[0]) if self.forced is not None else None  # [T, k]
        if self.softmax_after_topk:  # GPT-OSS: softmax over the k chosen logits
            top_ids = (forced if forced is not None
                       else torch.topk(logits, self.top_k, dim=-1).indices)
            return F.softmax(logits.gather(-1, top_ids), dim=-1).to(x.dtype), top_ids
        if self.routing.scoring == "sigmoid":
            scores = torch.sigmoid(logits)  # [T, E]
            top_ids = forced if forced is not None else self._sigmoid_top_ids(scores)
        else:
            scores = F.softmax(logits, dim=-1)  # [T, E]
            top_ids = (forced if forced is not None
                       else torch.topk(scores, self.top_k, dim=-1).indices)
        top_probs = scores.gather(-1, top_ids)  # [T, k]
        if self.norm_topk_prob:
            # The epsilon is the reference's (sigmoid weights can all be tiny).
            top_probs = top_probs / (top_probs.sum(dim=-1, keepdim=True) + 1e-20)
        if self.routing.scaling != 1.0:
            top_probs = top_probs * self.routing.scaling
        return top_probs.to(x.dtype), top_ids

    def _sigmoid_top_ids(self, scores: torch.Tensor) -> torch.Tensor:
        """GLM-4.5's choice [T, k] from the sigmoid scores [T, E]: the best k of scores plus
        the correction bias, within the routing's best groups."""
        choice = scores + self.e_score_correction_bias.float()  # [T, E], chooses only
        groups = self.routing.n_group
        if groups > 1:
            num_tokens, num_experts = choice.shape
            grouped = choice.view(num_tokens, groups, num_experts // groups)  # [T, G, E/G]
            best = min(2, grouped.shape[-1])
            group_scores = grouped.topk(best, dim=-1).values.sum(dim=-1)  # [T, G]
            kept = group_scores.topk(self.routing.topk_group, dim=-1).indices  # [T, g]
            mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
            choice = choice.masked_fill(~mask.repeat_interleave(num_experts // groups, 1),
                                        float("-inf"))
        return torch.topk(choice, self.top_k, dim=-1).indices  # [T, k]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.routed(x)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    def routed(self, x: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum for x [T, H], without the shared expert."""
        top_probs, top_ids = self.route(x)  # [T, k] each
        # One host sync per layer to learn which experts run; fine for batch-1 decoding.
        expert_ids = torch.unique(top_ids).tolist()
        provider = self.experts if self.expert_weights is None else self.expert_weights
        out = torch.zeros_like(x)  # [T, H]
        gates, ups, downs = provider.get(expert_ids)
        bias = self.expert_bias
        for j, expert_id in enumerate(expert_ids):
            token_idx, slot_idx = torch.where(top_ids == expert_id)  # [n], [n]
            h = x[token_idx]  # [n, H]
            if bias is None:
                gate, up = F.linear(h, gates[j]), F.linear(h, ups[j])
                y = F.linear(self.activation(gate, up), downs[j])  # [n, H]
            else:  # GPT-OSS: blocks (MXFP4) go through qlinear's kernels, not a dequantization
                gate = apply_linear(h, _matrix(gates, j), bias.gate[expert_id])
                up = apply_linear(h, _matrix(ups, j), bias.up[expert_id])
                y = apply_linear(self.activation(gate, up), _matrix(downs, j),
                                 bias.down[expert_id])
            out.index_add_(0, token_idx, y * top_probs[token_idx, slot_idx, None])
        return out


def _matrix(matrices: Sequence, j: int):
    """Matrix j of a provider's batch: a QuantizedWeight for quantized experts, else a tensor."""
    return matrices.weight(j) if isinstance(matrices, ExpertMatrices) else matrices[j]


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
