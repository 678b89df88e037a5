"""Fused [q;k;v] and [gate;up] weights as zero-copy views over the weights arena.

Decoding one token is bound by weight reads, and three small GEMVs cost more than one large
one (launches, and cuBLAS runs narrow k/v products well below bandwidth). So the arena lays
each group's tensors out back to back (`fusion_order`), and one view spans them
(`attach_fused_views`): same memory as the parameters, no copy, and like every arena view its
address survives release/refill/sleep/wake, so CUDA graphs captured over it stay valid.

Convention: after `attach_fused_views` every Attention has `qkv_weight`, `qkv_bias`,
`qkv_sizes` and every dense SwiGLU has `gate_up_weight`, each None where the group is not
adjacent; models built elsewhere (build_random_model) have none of them. Readers go through
`fused_qkv` / `fused_gate_up`, which treat absent and None alike. Weights held as GGML
blocks fuse the same way when the group shares one type: the view then is a QuantizedWeight.
q/k/v blocks of two types in two runs (Q4_K_M's q, k Q4_K and v Q6_K in half its layers)
get `qkv_pair` instead (`fused_qkv_pair`): one token's three products in one dp4a launch
(gemv_dp4a.matmul_pair); everything else keeps the separate products.
They are plain attributes, not parameters or buffers: state_dict and named_parameters never see them.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from strata.engine.core.memory.arena import Arena
    from strata.engine.core.quant.weight import QuantizedWeight

# name -> (group key, rank in the group); a group is laid out in rank order.
_GROUP_PATTERNS = (
    (re.compile(r"^(.*\.self_attn)\.([qkv])_proj\.(weight|bias)$"), "qkv"),
    (re.compile(r"^(.*\.mlp)\.(gate|up)_proj\.weight$"), "gate_up"),
)
_RANK = {"q": 0, "k": 1, "v": 2, "gate": 0, "up": 1}
_GROUP_SIZE = {"qkv": 3, "gate_up": 2}


def _group_of(name: str) -> tuple[tuple[str, ...], int] | None:
    for pattern, kind in _GROUP_PATTERNS:
        match = pattern.match(name)
        if match:
            param = match.group(3) if kind == "qkv" else "weight"
            return (match.group(1), kind, param), _RANK[match.group(2)]
    return None


def fusion_order(names: Sequence[str]) -> list[str]:
    """names reordered so each complete fusion group is adjacent and in rank order (q, k, v;
    gate, up), placed where its first member was; every other name keeps its place."""
    groups: dict[tuple[str, ...], list[tuple[int, str]]] = {}
    for name in names:
        found = _group_of(name)
        if found is not None:
            groups.setdefault(found[0], []).append((found[1], name))
    ordered, placed = [], set()
    for name in names:
        found = _group_of(name)
        members = groups.get(found[0]) if found is not None else None
        if members is None or len(members) != _GROUP_SIZE[found[0][1]]:
            ordered.append(name)  # not a group member, or an incomplete group: as it was
        elif found[0] not in placed:
            placed.add(found[0])
            ordered.extend(member for _, member in sorted(members))
    return ordered


def same_group(name: str, other: str) -> bool:
    """Whether two tensor names belong to one fusion group (q/k/v of a layer, gate/up)."""
    a, b = _group_of(name), _group_of(other)
    return a is not None and b is not None and a[0] == b[0]


def adjacent_view(arena: Arena, tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """One arena view [sum of dim 0, *rest] spanning tensors that lie back to back, else None.

    Checked by address arithmetic, not assumed: an alignment gap, a dtype or shape mismatch or
    a tensor outside the arena gives None, and the caller keeps the separate tensors.
    """
    first = tensors[0]
    expected_ptr = first.data_ptr()
    for tensor in tensors:
        if (tensor.data_ptr() != expected_ptr or not tensor.is_contiguous()
                or tensor.dtype != first.dtype or tensor.device != first.device
                or tensor.shape[1:] != first.shape[1:]):
            return None
        expected_ptr += tensor.nbytes
    offset_bytes = first.data_ptr() - arena.base_address
    if offset_bytes < 0 or expected_ptr - arena.base_address > arena.reserved_bytes:
        return None
    rows = sum(t.shape[0] for t in tensors)
    return arena.tensor(offset_bytes, (rows, *first.shape[1:]), first.dtype)


def adjacent_weight(arena: Arena, weights: Sequence) -> torch.Tensor | QuantizedWeight | None:
    """adjacent_view for float weights; for QuantizedWeights of one GGML type, the blocks'
    view wrapped as one QuantizedWeight (a row's blocks follow the previous row's), else None."""
    # Imported here: quant.weight imports fast/, whose forward.py imports this module.
    from strata.engine.core.quant.weight import QuantizedWeight

    if not any(isinstance(w, QuantizedWeight) for w in weights):
        return adjacent_view(arena, weights)
    first = weights[0]
    if not all(isinstance(w, QuantizedWeight) and w.qtype == first.qtype
               and w.shape[1] == first.shape[1] for w in weights):
        return None  # mixed types (Q4_K_M puts some v / down in Q6_K): separate products
    raw = adjacent_view(arena, [w.raw for w in weights])
    if raw is None:
        return None
    return QuantizedWeight(first.qtype, (raw.shape[0], first.shape[1]), raw, first.dtype)


def adjacent_pair(arena: Arena, weights: Sequence):
    """A gemv_dp4a.QuantizedPair over QuantizedWeights lying back to back in the arena whose
    types form two runs (a, a, b or a, b, b) that matmul_pair takes; else None."""
    from strata.engine.core.quant.weight import QuantizedWeight

    if not all(isinstance(w, QuantizedWeight) for w in weights):
        return None
    types = [int(w.qtype) for w in weights]
    split = next((i for i in range(1, len(types)) if types[i] != types[0]), None)
    if (split is None or any(t != types[split] for t in types[split:])
            or any(w.shape[1] != weights[0].shape[1] or not w.raw.is_contiguous()
                   for w in weights)):
        return None  # one type (adjacent_weight's), three runs, other widths or strides
    # The two types' rows differ in bytes: one flat view over all of their blocks.
    raw = adjacent_view(arena, [w.raw.view(-1) for w in weights])
    if raw is None:
        return None
    # Imported here, at load: importing it decorates Triton kernels (quant/weight.py).
    from strata.engine.core.quant import gemv_dp4a

    rows = (sum(w.shape[0] for w in weights[:split]), sum(w.shape[0] for w in weights[split:]))
    row_bytes = (weights[0].raw.shape[1], weights[split].raw.shape[1])
    qtypes = (types[0], types[split])
    if not gemv_dp4a.pair_supported(qtypes, row_bytes, weights[0].shape[1], raw.data_ptr(),
                                    rows[0]):
        return None
    return gemv_dp4a.QuantizedPair(raw, qtypes, rows, row_bytes, weights[0].shape[1])


def _fuse_attention(attn, arena: Arena) -> None:
    projs = (attn.q_proj, attn.k_proj, attn.v_proj)
    weights = [p.weight for p in projs]
    has_bias = projs[0].bias is not None
    bias = adjacent_view(arena, [p.bias for p in projs]) if has_bias else None
    fusable = bias is not None or not has_bias  # all or nothing: else the unfused path
    weight = adjacent_weight(arena, weights) if fusable else None
    pair = adjacent_pair(arena, weights) if fusable and weight is None else None
    _set_qkv(attn, weight, bias if weight is not None or pair is not None else None)
    attn.qkv_pair = pair


def _set_qkv(attn, weight: torch.Tensor | None, bias: torch.Tensor | None) -> None:
    attn.qkv_weight = weight  # [Nq + Nk + Nv, H]
    attn.qkv_bias = bias  # [Nq + Nk + Nv] or None (also the pair's, for qkv_pair)
    projs = (attn.q_proj, attn.k_proj, attn.v_proj)
    attn.qkv_sizes = tuple(p.weight.shape[0] for p in projs)


def attach_fused_views(model: torch.nn.Module, arena: Arena) -> dict[str, int]:
    """Set the fused views on every attention and dense SwiGLU of model whose weights in
    `arena` are adjacent (None on the others); returns how many of each were fused."""
    # Imported here: models.layers imports fast/, whose forward.py imports this module.
    from strata.engine.core.models.layers import Attention, SwiGLU

    counts = {"qkv": 0, "gate_up": 0}
    for layer in model.model.layers:
        if isinstance(layer.self_attn, Attention):
            _fuse_attention(layer.self_attn, arena)
            counts["qkv"] += layer.self_attn.qkv_weight is not None
        mlp = layer.mlp
        if isinstance(mlp, SwiGLU):  # MoE experts are stacked elsewhere: never fused here
            mlp.gate_up_weight = adjacent_weight(arena, [mlp.gate_proj.weight,
                                                          mlp.up_proj.weight])
            counts["gate_up"] += mlp.gate_up_weight is not None
    return counts


def fuse_by_copy(model: torch.nn.Module) -> dict[str, int]:
    """For a model whose weights are ordinary torch tensors (build_random_model: the speed
    bench), give each q/k/v and gate/up group one storage and re-point the parameters at
    slices of it: the same layout and fused views the arena path gives, at no extra memory
    once the old tensors are gone. Returns how many of each were fused."""
    from strata.engine.core.models.layers import Attention, SwiGLU

    def regroup(linears: list) -> tuple[torch.Tensor, torch.Tensor | None]:
        weight = torch.cat([lin.weight for lin in linears])
        has_bias = linears[0].bias is not None
        bias = torch.cat([lin.bias for lin in linears]) if has_bias else None
        begin = 0
        for lin in linears:
            rows = lin.weight.shape[0]
            lin.weight = torch.nn.Parameter(weight[begin:begin + rows], requires_grad=False)
            if has_bias:
                lin.bias = torch.nn.Parameter(bias[begin:begin + rows], requires_grad=False)
            begin += rows
        return weight, bias

    counts = {"qkv": 0, "gate_up": 0}
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if isinstance(attn, Attention):
            _set_qkv(attn, *regroup([attn.q_proj, attn.k_proj, attn.v_proj]))
            counts["qkv"] += 1
        if isinstance(mlp, SwiGLU):
            mlp.gate_up_weight, _ = regroup([mlp.gate_proj, mlp.up_proj])
            counts["gate_up"] += 1
    return counts


def detach_fused_views(model: torch.nn.Module) -> None:
    """Set every fused view to None: the fast path then runs the separate projections."""
    for layer in model.model.layers:
        for module, names in ((layer.self_attn, ("qkv_weight", "qkv_bias", "qkv_sizes",
                                                 "qkv_pair")),
                              (layer.mlp, ("gate_up_weight",))):
            for name in names:
                if hasattr(module, name):
                    setattr(module, name, None)


def fused_qkv(attn) -> tuple[torch.Tensor, torch.Tensor | None, tuple[int, int, int]] | None:
    """(weight [Nq+Nk+Nv, H], bias or None, (Nq, Nk, Nv)) when attn has a fused view, else None."""
    weight = getattr(attn, "qkv_weight", None)
    return None if weight is None else (weight, attn.qkv_bias, attn.qkv_sizes)


def fused_qkv_pair(attn):
    """(gemv_dp4a.QuantizedPair, bias or None, (Nq, Nk, Nv)) when attn's q/k/v blocks are
    two types in two runs back to back, else None."""
    pair = getattr(attn, "qkv_pair", None)
    return None if pair is None else (pair, attn.qkv_bias, attn.qkv_sizes)


def fused_gate_up(mlp) -> torch.Tensor | None:
    """The [2I, H] view over gate and up when mlp has one, else None."""
    return getattr(mlp, "gate_up_weight", None)
