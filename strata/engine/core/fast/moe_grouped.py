"""Decode-time expert computation without a per-expert Python loop or a host sync.

The reference SparseMoE (models/switch.py) asks the host which experts run (`unique().tolist()`)
and loops over them: a sync per layer, so a decode step cannot live in a CUDA graph. When every
expert is resident (the stacked parameters, no expert cache), the expert ids can stay on the
device instead:

- "triton": three kernels (route + top-k, gate/up, down + weighted sum) read the ids from
  device memory and only the selected experts' rows (moe_triton.py); the weights are read
  once, as the roofline assumes.
- "bmm": index_select the k experts' stacked weights, then batched matmuls. Plain torch, runs
  anywhere, but copies the selected weights first (about 3x the expert bytes moved).
- "loop": the reference module itself (host sync; no CUDA graph).

With a partial expert cache (a provider with a SlotLayout), one token takes the "triton"
kernels through the cache's slot table: resident experts from their slots, the others read in
place from the pinned host copy, or computed on the CPU meanwhile where the cache's
cpu_expert_misses says (moe_cpu_misses.py); the cache promotes them between steps
(expert_promotion.py).
Many tokens stage the layer's experts whole and take the grouped GEMMs (moe_staged.py).

Many tokens (prefill) with resident experts take the sorted grouped GEMMs of moe_prefill.py
whatever the decode choice, except "loop". `select_moe_impl` picks at load; the benchmark
measures the decode paths.

Layers other than Qwen3-MoE's kind branch on flags SparseMoE fixes at build: GLM-4.5's sigmoid
routing (one group) and GPT-OSS's biased router take the Triton routers' other variants
(`router_kind`), grouped routing (n_group > 1) the module's own device ops; GPT-OSS's expert
biases and clamped SwiGLU are the expert kernels' epilogue (expert_epilogue.py), its MXFP4
experts read by the tile decoder's GEMV (quant/expert_tile_gemv.py); GLM's shared expert is
added by the dense path (`moe_forward`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from strata.engine.core.fast import expert_epilogue
from strata.engine.core.fast.expert_epilogue import Epilogue
from strata.engine.core.fast.moe_prefill import moe_block, route_logits
from strata.engine.core.fast.moe_staged import staged_experts, stages
from strata.engine.core.fast.pointwise import EAGER_OPS, PointwiseOps
from strata.engine.core.fast.shared_expert import shared_expert
from strata.engine.core.kernels import launch
from strata.engine.core.models.switch import Routing, SlotLayout, SparseMoE
from strata.engine.core.quant.experts import is_quantized_experts

if TYPE_CHECKING:
    from strata.engine.core.fast.moe_triton import RouterKind

log = logging.getLogger(__name__)

MOE_IMPLS = ("triton", "bmm", "loop")


def triton_available(device: torch.device) -> bool:
    """Whether the Triton kernels can run for tensors on `device` (CUDA, or the interpreter)."""
    return launch.is_usable(device)


def select_moe_impl(requested: str, device: torch.device) -> str:
    """The implementation to use: `requested` if it can run here, else the best one that can.

    "auto" means triton where Triton works on this device, else bmm.
    """
    if requested not in (*MOE_IMPLS, "auto"):
        raise ValueError(f"moe_impl must be auto, {', '.join(MOE_IMPLS)}; not {requested!r}")
    if requested in ("auto", "triton"):
        if triton_available(device):
            return "triton"
        if requested == "triton":
            log.warning("Triton is not usable on %s; MoE decode falls back to bmm", device)
        return "bmm"
    return requested


def slot_layout(moe: SparseMoE) -> SlotLayout | None:
    """The layer's partial-cache layout, when its expert provider offers one (SlotExperts)."""
    layout = getattr(moe.expert_weights, "layout", None)
    return layout if isinstance(layout, SlotLayout) else None


def expert_stacks(moe: SparseMoE, layout: SlotLayout | None) -> tuple:
    """(gate, up, down, slot table, host offsets) the expert kernels read: the resident
    stacks (no table), or a partial cache's slots with its table and host-copy offsets."""
    if layout is None:
        stacked = moe.experts
        return stacked.gate_proj, stacked.up_proj, stacked.down_proj, None, (0, 0, 0)
    return layout.gate, layout.up, layout.down, layout.table, layout.host_offsets


def is_grouped_capable(moe: SparseMoE, impl: str = "triton") -> bool:
    """Whether one token's experts can run without asking the host which: stacked resident
    parameters (any grouped impl), or a partial cache's slot table (the Triton kernels)."""
    if moe.expert_weights is None:
        # bmm index_selects float stacks; quantized experts are dequantized by Triton.
        return impl == "triton" or not is_quantized_experts(moe.experts.gate_proj)
    return impl == "triton" and slot_layout(moe) is not None


def route(moe: SparseMoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] in x's dtype, expert ids [T, k]) exactly as SparseMoE routes (a
    benchmark's forced ids included). Routing other than softmax top-k (GLM-4.5's sigmoid
    with its correction bias, groups and scaling; GPT-OSS's biased router and softmax over
    the top-k logits) is the module's own: device ops only, no host sync."""
    if not moe.softmax_routing:
        return moe.route(x)
    if moe.forced is None:
        return route_logits(moe.router(x), moe.top_k, moe.norm_topk_prob, x.dtype)
    probs = F.softmax(moe.router(x).float(), dim=-1)  # [T, E]
    ids = moe.forced.rows(x.shape[0])  # [T, k]
    weights = probs.gather(-1, ids)  # [T, k]
    if moe.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(x.dtype), ids


def router_kind(moe: SparseMoE) -> RouterKind | None:
    """What the Triton routers do for this layer (moe_triton.RouterKind), from its build-time
    shape; None where only the module's own routing serves (GLM-style groups, n_group > 1).
    A benchmark's forced ids take the module's own routing outside softmax (SparseMoE.route)."""
    from strata.engine.core.fast import moe_triton  # decorates kernels: on first use

    if moe.softmax_routing:
        return moe_triton.SOFTMAX
    if moe.forced is not None:
        return None
    routing = moe.routing
    if moe.softmax_after_topk and routing == Routing():  # GPT-OSS
        return moe_triton.RouterKind(bias=moe.router.bias)
    if (routing.scoring == "sigmoid" and routing.n_group == 1 and moe.router.bias is None
            and not moe.softmax_after_topk):  # GLM-4.5, GLM-4.6
        return moe_triton.RouterKind(correction=moe.e_score_correction_bias,
                                     scaling=routing.scaling)
    return None


def routed_norm(moe: SparseMoE) -> bool:
    """Whether the routers renormalise the top-k weights: norm_topk_prob, or softmax over
    the top-k logits (GPT-OSS), which is softmax top-k renormalised."""
    return moe.norm_topk_prob or moe.softmax_after_topk


def experts_bmm(moe: SparseMoE, x: torch.Tensor, weights, ids) -> torch.Tensor:
    """One token's experts by batched matmul over index-selected weights; x [1, H] -> [1, H]."""
    stacked = moe.experts
    ids = ids[0]  # [k]
    gate = stacked.gate_proj.index_select(0, ids)  # [k, I, H]
    up = stacked.up_proj.index_select(0, ids)  # [k, I, H]
    down = stacked.down_proj.index_select(0, ids)  # [k, H, I]
    xs = x.expand(ids.shape[0], -1).unsqueeze(-1)  # [k, H, 1]
    epilogue = expert_epilogue.of(moe)
    if epilogue is None:
        act = F.silu(torch.bmm(gate, xs)) * torch.bmm(up, xs)  # [k, I, 1]
        y = torch.bmm(down, act).squeeze(-1)  # [k, H]
    else:
        gate_bias, up_bias, down_bias = expert_epilogue.row_biases(epilogue, ids)
        g, u = torch.bmm(gate, xs).squeeze(-1), torch.bmm(up, xs).squeeze(-1)  # [k, I]
        if gate_bias is not None:
            g, u = g + gate_bias, u + up_bias
        y = torch.bmm(down, epilogue.activate(g, u).unsqueeze(-1)).squeeze(-1)  # [k, H]
        if down_bias is not None:
            y = y + down_bias
    return (y * weights[0, :, None]).sum(dim=0, keepdim=True)  # [1, H]


def takes_rounded_x(moe: SparseMoE, x: torch.Tensor, impl: str) -> bool:
    """Whether one token x [1, H] of this block reaches quantized experts that multiply it by
    dp4a (expert_gemv), so the norm before can round x to int8 in its own launch
    (fast/decode_rounded.py) and the experts take that rounding."""
    if x.shape[0] != 1 or impl != "triton" or not is_grouped_capable(moe, impl):
        return False
    gate, up, down, table, offsets = expert_stacks(moe, slot_layout(moe))
    if not is_quantized_experts(gate):
        return False
    from strata.engine.core.quant import expert_gemv

    # routed_experts' choice: an epilogue's or MXFP4 experts by dp4a take it too
    return (expert_gemv.takes(gate, up, down, x, table, offsets, expert_epilogue.of(moe))
            and (expert_gemv.uses_dp4a(gate, x) or expert_gemv.uses_dp4a(up, x)))


def experts_triton(moe: SparseMoE, x: torch.Tensor, use_pdl: bool = False,
                   layout: SlotLayout | None = None,
                   rounded: tuple | None = None) -> torch.Tensor:
    """One token's MoE block by three Triton kernels (route, gate/up, down+sum); x [1, H].

    With a partial expert cache's layout the kernels read through its slot table, and the
    router leaves its ids in layout.step_ids[0], where the cache learns what to promote.
    rounded: x's int8 rounding made with x, for quantized experts multiplied by dp4a."""
    weights, ids = route_token(moe, x, layout, use_pdl)
    on_gpu = gpu_experts(moe, x, layout, use_pdl, rounded)
    if layout is not None and layout.cpu_misses is not None:  # misses on the CPU meanwhile
        return layout.cpu_misses.routed(moe, x, ids, weights, on_gpu)
    return on_gpu(ids, weights)


def route_token(moe: SparseMoE, x: torch.Tensor, layout: SlotLayout | None = None,
                use_pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [k], ids [k]) of one token x [1, H] on the device, by the Triton routers or
    the module's own; with a layout the ids land in layout.step_ids[0] too."""
    from strata.engine.core.fast import moe_triton

    out_ids = layout.step_ids[0] if layout is not None else None
    kind = router_kind(moe)
    if kind is not None:
        forced_ids = moe.forced.ids if moe.forced is not None else None
        return moe_triton.router_topk(x[0], moe.router.weight, moe.top_k, routed_norm(moe),
                                      out_ids=out_ids, use_pdl=use_pdl, forced_ids=forced_ids,
                                      router=kind)
    weights, ids = (t[0] for t in moe.route(x))  # groups of experts: by device ops
    if out_ids is not None:
        ids = out_ids.copy_(ids)
    return weights, ids


def gpu_experts(moe: SparseMoE, x: torch.Tensor, layout: SlotLayout | None = None,
                use_pdl: bool = False, rounded: tuple | None = None):
    """(ids [k], weights [k]) -> [1, H]: one token x's given experts by the slot-table (or
    resident) kernels, the layer's epilogue applied."""
    gate, up, down, table, offsets = expert_stacks(moe, layout)
    epilogue = expert_epilogue.of(moe)

    def on_gpu(ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return routed_experts(x, gate, up, down, ids, weights, table, offsets, use_pdl,
                              rounded, epilogue)

    return on_gpu


def routed_experts(x: torch.Tensor, gate, up, down, ids: torch.Tensor, weights: torch.Tensor,
                   table: torch.Tensor | None = None,
                   offsets: tuple[int, int, int] = (0, 0, 0),
                   use_pdl: bool = False, rounded: tuple | None = None,
                   epilogue: Epilogue | None = None) -> torch.Tensor:
    """One routed token's experts: x [1, H], ids and weights [k] on the device -> [1, H].
    Float or quantized stacks (or a partial cache's slots, through table and offsets);
    rounded: x's int8 rounding, read where the quantized experts take dp4a; epilogue: GPT-OSS's
    expert biases and clamped SwiGLU (expert_epilogue.py), which expert_gemv's dp4a kernels,
    expert_tile_gemv and the grouped float kernels apply."""
    from strata.engine.core.fast import moe_triton

    bias_ids = ids
    if is_quantized_experts(gate):
        from strata.engine.core.quant import expert_gemv, expert_tile_gemv
        from strata.engine.core.quant.expert_kernels import dequantize_routed

        if expert_gemv.takes(gate, up, down, x[0], table, offsets, epilogue):
            return expert_gemv.routed_mlp(x[0], gate, up, down, ids, weights, table, offsets,
                                          use_pdl, rounded, epilogue)[None]  # [1, H]
        if expert_tile_gemv.takes(gate, epilogue):  # the rest of MXFP4 and GPT-OSS
            return expert_tile_gemv.routed_mlp(x[0], gate, up, down, ids, weights, table,
                                               offsets, epilogue)[None]  # [1, H]
        # Other types: the k routed experts dequantized by the tile decoder, then as float.
        gate, up, down, ids = dequantize_routed(gate, up, down, ids, table, offsets)
        table, offsets = None, (0, 0, 0)
    act = moe_triton.grouped_gate_up(x[0], gate, up, ids, table, offsets[:2],
                                     use_pdl=use_pdl, epilogue=epilogue,
                                     bias_ids=bias_ids)  # [k, I]
    return moe_triton.grouped_down_sum(act, down, ids, weights, table, offsets[2],
                                       use_pdl=use_pdl, epilogue=epilogue,
                                       bias_ids=bias_ids)[None]  # [1, H]


def moe_forward(
    moe: SparseMoE, x: torch.Tensor, impl: str, ops: PointwiseOps = EAGER_OPS,
    rounded: tuple | None = None,
) -> torch.Tensor:
    """The MoE block on x [T, H]: the loop module for "loop"; else grouped.

    Grouped means, for one token, the `impl` kernels (triton / bmm); for many tokens (prefill),
    rows sorted by expert and grouped GEMMs (moe_prefill.py). rounded: one token's int8
    rounding made with x (takes_rounded_x), read by the quantized experts' dp4a.
    """
    if impl == "loop" or not is_grouped_capable(moe, impl):
        return moe(x)
    routed = _routed_forward(moe, x, impl, ops, rounded)
    if moe.shared_experts is None:
        return routed
    return routed + shared_expert(moe.shared_experts, x, ops)  # GLM-4.5's


def _routed_forward(moe: SparseMoE, x: torch.Tensor, impl: str, ops: PointwiseOps,
                    rounded: tuple | None) -> torch.Tensor:
    """The routed experts' part of moe_forward (grouped: not the loop)."""
    if moe.expert_weights is not None:
        # A partial cache: one token reads through the slot table; many (prefill) stage the
        # layer's experts and run the grouped GEMMs (moe_staged.py), or, without a staging
        # area, take the loop, which copies their misses in (the table follows).
        if stages(moe, x):
            return staged_experts(moe, x, *route(moe, x), ops)
        if x.shape[0] != 1:
            return moe.routed(x)
        return experts_triton(moe, x, ops.pdl, slot_layout(moe), rounded)
    if x.shape[0] == 1 and impl == "triton":
        return experts_triton(moe, x, ops.pdl, None, rounded)
    if x.shape[0] != 1:
        # A benchmark's forced prefill rows are read on the host: the loop takes them.
        return moe_block(moe, x, ops) if moe.forced is None else moe.routed(x)
    weights, ids = route(moe, x)
    if impl == "bmm":
        return experts_bmm(moe, x, weights, ids)
    raise ValueError(f"moe_impl must be one of {', '.join(MOE_IMPLS)}; not {impl!r}")
