"""A decoder step written for speed: graph-capturable, no host sync.

Same modules and weights as models/decoder.py (the numerical reference), different schedule:
`decode_step` takes the token and its position as device tensors, writes K/V with
`index_copy_` and attends over a fixed number of key slots (the KV-length bucket) with a mask
past the position. Nothing in it reads a value back to the host, so a CUDA graph captured once
per bucket replays for every position inside that bucket. The chunked prefill is prefill.py.
Where the weights arena holds q/k/v (gate/up) back to back, one GEMM over the fused view
(fused_views.py) replaces three (two); the outputs are split into views, never copied. q/k/v
blocks of two types take one dp4a launch for one token (gemv_dp4a.matmul_pair).
What an architecture adds (Gemma's sandwich norms and GeGLU, its embedding and RoPE tables,
soft-capped logits; attention windows, scales and sinks) is read from the modules while the
step is traced, so a graph holds only the kernels the model needs (fast_coverage.py).
`decode_step_segments` is the same step cut where a partial cache's CPU-computed misses need
the host (moe_cpu_misses.py), each segment free of host syncs.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from functools import partial

import torch

from strata.engine.core.fast import decode_dense, decode_rounded
from strata.engine.core.fast.decode_attention import (
    fused_decode_attention,
    fused_decode_attention_rounded,
    reference_decode_attention,
    rounds_output,
)
from strata.engine.core.fast.linear import linear
from strata.engine.core.fast.moe_grouped import (
    gpu_experts,
    moe_forward,
    route_token,
    slot_layout,
    takes_rounded_x,
)
from strata.engine.core.fast.pointwise import (
    EAGER_OPS,
    PointwiseOps,
    apply_add_norm,
    apply_norm,
    attn_qk_norm_rope,
    gate_mul,
    is_unit_offset,
)
from strata.engine.core.fast.shared_expert import shared_expert
from strata.engine.core.fused_views import fused_gate_up, fused_qkv, fused_qkv_pair
from strata.engine.core.kv_cache import KVCache
from strata.engine.core.models.decoder import SandwichDecoderLayer
from strata.engine.core.models.layers import GeGLU
from strata.engine.core.models.switch import SparseMoE
from strata.engine.core.quant import weight as qweight


def gemv_dp4a():
    """quant/gemv_dp4a.py, imported on first use (it decorates Triton kernels: quant/weight.py)."""
    from strata.engine.core.quant import gemv_dp4a as module

    return module


def head_weight(model) -> torch.Tensor:
    """The output projection [V, H]: lm_head, or the embedding table of a tied model."""
    return model.model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight


def project_head(x: torch.Tensor, model, use_pdl: bool = False,
                 rounded: tuple | None = None) -> torch.Tensor:
    """Logits [T, V] float32 for x [T, H], whatever form the head's weight takes. use_pdl: a
    quantized head's one-token product launches as a PDL secondary (qlinear), as the decode
    step's other products do; rounded: x's int8 rounding made with x (decode_rounded.py)."""
    logits = qweight.apply_linear(x, head_weight(model), use_pdl=use_pdl,
                                  rounded=rounded).float()
    cap = model.config.final_logit_softcapping
    return logits if not cap else torch.tanh(logits / cap) * cap  # Gemma's soft-capping


def block_norms(layer) -> tuple:
    """(after attention, before the MLP, after the MLP): a pre-norm block has only the middle
    one (its post_attention_layernorm); Gemma's sandwich block all three (decoder.py)."""
    if isinstance(layer, SandwichDecoderLayer):
        return (layer.post_attention_layernorm, layer.pre_feedforward_layernorm,
                layer.post_feedforward_layernorm)
    return None, layer.post_attention_layernorm, None


def project_qkv(attn, x: torch.Tensor, ops: PointwiseOps = EAGER_OPS,
                rounded: tuple | None = None):
    """q [T, Hq*D], k and v [T, Hkv*D] for x [T, H]: one GEMM over the fused view if any.
    rounded: x's int8 rounding made with x, for the quantized products of one token.

    The fused outputs are column slices of one [T, Nq+Nk+Nv] tensor: contiguous for T=1,
    row-strided for T>1 (every consumer reshapes only the last dim or copies).
    """
    fused = fused_qkv(attn)
    if fused is None:
        paired = fused_qkv_pair(attn)
        if paired is not None and gemv_dp4a().is_pair_enabled(x):  # one token, two types
            pair, bias, sizes = paired
            return gemv_dp4a().matmul_pair(x, pair, bias, use_pdl=ops.pdl,
                                           rounded=rounded).split(sizes, dim=-1)
        return tuple(linear(x, p.weight, p.bias, ops, rounded)
                     for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    weight, bias, sizes = fused
    # [T, Nq+Nk+Nv] -> three views
    return linear(x, weight, bias, ops, rounded).split(sizes, dim=-1)


def qkv(attn, x: torch.Tensor, cos, sin, ops: PointwiseOps):
    """q [T, Hq, D], k [T, Hkv, D] (q/k-normed and rotated), v [T, Hkv, D] for x [T, H]."""
    num_tokens = x.shape[0]
    q, k, v = project_qkv(attn, x)
    q = q.view(num_tokens, attn.num_heads, attn.head_dim)  # [T, Hq, D]
    k = k.view(num_tokens, attn.num_kv_heads, attn.head_dim)  # [T, Hkv, D]
    v = v.view(num_tokens, attn.num_kv_heads, attn.head_dim)  # [T, Hkv, D]
    return (*attn_qk_norm_rope(attn, q, k, cos, sin, ops), v)


def attention_decode(
    attn,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    position: torch.Tensor,
    key_positions: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    ops: PointwiseOps,
) -> torch.Tensor:
    """One token's attention over the first len(key_positions) cache slots, then o_proj;
    q [1, Hq*D], k and v [1, Hkv*D] as projected (contiguous for one token). Where o_proj
    takes dp4a, the attention's last kernel rounds its output to int8 too."""
    args = (attn, q, k, v, cos, sin, k_cache, v_cache, position, key_positions)
    rounded = None
    if not ops.fused_attention:
        out = reference_decode_attention(*args, ops=ops)
    elif rounds_output(attn, q.dtype) and _rounds_x(q, attn.o_proj.weight, ops):
        out, rounded = fused_decode_attention_rounded(*args, use_pdl=ops.pdl)
    else:
        out = fused_decode_attention(*args, use_pdl=ops.pdl)
    return linear(out, attn.o_proj.weight, attn.o_proj.bias, ops, rounded)


def _rounds_x(x: torch.Tensor, weight, ops: PointwiseOps) -> bool:
    """Whether the kernel that makes one token's x [1, K] (a norm, SiLU·mul) rounds it to int8
    too (decode_rounded.py): the product by `weight` after it takes dp4a (a QuantizedWeight of a
    dp4a type, or q/k/v's QuantizedPair), so a launch of quantize_x is saved."""
    if not (ops.dense_kernels and x.shape[0] == 1):
        return False
    if isinstance(weight, qweight.QuantizedWeight):
        return gemv_dp4a().is_enabled(x, weight.qtype, weight.raw)
    return isinstance(weight, gemv_dp4a().QuantizedPair) and gemv_dp4a().is_pair_enabled(x)


def _norm_token(h: torch.Tensor, y: torch.Tensor | None, norm, ops: PointwiseOps,
                rounds: bool = False, y_norm=None):
    """(h + y, norm(h + y), rounded) for one token; y None (the first layer): h itself.
    rounded: norm(h + y)'s int8 rounding from the same launch where `rounds` (the product
    after it takes dp4a: _rounds_x, takes_rounded_x), else None. y_norm: a norm module that
    y passes first (Gemma's post-sublayer norm), in the same launch with the dense kernels."""
    offset = is_unit_offset(norm)
    fused_y_norm = None
    if y_norm is not None:
        if ops.dense_kernels and is_unit_offset(y_norm) == offset:
            fused_y_norm = (y_norm.weight, y_norm.eps)
        else:
            y = apply_norm(ops, y, y_norm)
    if rounds:
        return decode_rounded.add_rms_norm_rounded(h, y, norm.weight, norm.eps, use_pdl=ops.pdl,
                                                   unit_offset=offset, y_norm=fused_y_norm)
    if ops.dense_kernels:
        return (*decode_dense.add_rms_norm(h, y, norm.weight, norm.eps, use_pdl=ops.pdl,
                                           unit_offset=offset, y_norm=fused_y_norm), None)
    return (*apply_add_norm(ops, h, y, norm), None)


def _takes_prologue(x: torch.Tensor, weight: torch.Tensor, ops: PointwiseOps) -> bool:
    """Whether the step before a product of one token x by weight runs in the GEMV's prologue
    (decode_dense.use_prologue: where saving its launch pays)."""
    return (ops.dense_kernels and ops.gemv_prologues and x.shape[0] == 1
            and not isinstance(weight, qweight.QuantizedWeight)
            and decode_dense.use_prologue(weight))


def _norm_linear(h, y, norm, weight, bias, ops: PointwiseOps, y_norm=None):
    """(h + y, linear(norm(h + y), weight, bias)) for one token: one launch (decode_dense's
    norm_gemv) where it pays, else the norm then the projection. y_norm: _norm_token's."""
    if _takes_prologue(h, weight, ops):
        if y_norm is not None:
            y = _norm_token(y, None, y_norm, ops)[1]
        return decode_dense.norm_gemv(h, y, norm.weight, norm.eps, weight, bias, use_pdl=ops.pdl,
                                      unit_offset=is_unit_offset(norm))
    h, x, rounded = _norm_token(h, y, norm, ops, _rounds_x(h, weight, ops), y_norm)
    return h, linear(x, weight, bias, ops, rounded)


def _norm_qkv(attn, h, y, norm, ops: PointwiseOps, y_norm=None):
    """(h + y, (q, k, v)) for one token: the input norm and the q/k/v projections.
    y_norm: _norm_token's."""
    fused = fused_qkv(attn)
    if fused is None:
        paired = fused_qkv_pair(attn)
        weight = paired[0] if paired is not None else attn.q_proj.weight
        h, x, rounded = _norm_token(h, y, norm, ops, _rounds_x(h, weight, ops), y_norm)
        return h, project_qkv(attn, x, ops, rounded)
    weight, bias, sizes = fused
    h, out = _norm_linear(h, y, norm, weight, bias, ops, y_norm)
    return h, out.split(sizes, dim=-1)


def _norm_mlp(mlp, h, y, norm, ops: PointwiseOps, moe_impl: str, y_norm=None):
    """(h + y, mlp(norm(h + y))) for one token. A dense SwiGLU with the fused gate/up view
    takes the norm into its gate/up GEMV where that pays: with `_down`, 2 launches, not 4.
    y_norm: _norm_token's."""
    if isinstance(mlp, SparseMoE):
        rounds = ops.dense_kernels and takes_rounded_x(mlp, h, moe_impl)
        h, x, rounded = _norm_token(h, y, norm, ops, rounds, y_norm)
        return h, moe_forward(mlp, x, moe_impl, ops, rounded)
    gate_up = fused_gate_up(mlp)
    if gate_up is None:
        h, x, rounded = _norm_token(h, y, norm, ops, _rounds_x(h, mlp.gate_proj.weight, ops),
                                    y_norm)
        return h, mlp_forward(mlp, x, ops, moe_impl, rounded)
    h, gate_up_out = _norm_linear(h, y, norm, gate_up, None, ops, y_norm)  # [1, 2I]
    return h, _down(mlp, gate_up_out, ops)


def _down(mlp, gate_up_out: torch.Tensor, ops: PointwiseOps) -> torch.Tensor:
    """down_proj(silu(gate) * up) for gate_up_out [T, 2I] = [gate | up] (GeGLU: gelu_tanh):
    one launch (decode_dense.silu_mul_gemv) for one token where it pays."""
    down = mlp.down_proj
    gelu = isinstance(mlp, GeGLU)
    if _takes_prologue(gate_up_out, down.weight, ops):
        return decode_dense.silu_mul_gemv(gate_up_out, down.weight, down.bias, use_pdl=ops.pdl,
                                          gelu=gelu)
    if _rounds_x(gate_up_out, down.weight, ops):  # SiLU·mul and x's int8 in one launch
        x, rounded = decode_rounded.silu_mul_rounded(gate_up_out, use_pdl=ops.pdl, gelu=gelu)
        return linear(x, down.weight, down.bias, ops, rounded)
    gate, up = gate_up_out.chunk(2, dim=-1)  # two [T, I] views
    return linear(gate_mul(ops, mlp, gate, up), down.weight, down.bias, ops)


def moe_token(layer, h: torch.Tensor, ops: PointwiseOps, moe_impl: str) -> torch.Tensor:
    """One token h [1, H] through a MoE layer's norm and experts as decode_step runs them
    (a block output to add, so the same norm kernels); what warms the kernels of an expert
    provider the step has not read yet (GraphDecoder.warm_expert_cache)."""
    after_attn, before_mlp, _ = block_norms(layer)
    return _norm_mlp(layer.mlp, h, torch.zeros_like(h), before_mlp, ops, moe_impl, after_attn)[1]


def mlp_forward(mlp, x: torch.Tensor, ops: PointwiseOps, moe_impl: str,
                rounded: tuple | None = None) -> torch.Tensor:
    """The layer's feed-forward on x [T, H]: SwiGLU (or GeGLU) with fused activation, or the
    MoE path.
    rounded: one token's int8 rounding made with x, for the quantized products by dp4a."""
    if isinstance(mlp, SparseMoE):
        return moe_forward(mlp, x, moe_impl, ops, rounded)
    gate_up = fused_gate_up(mlp)
    if gate_up is not None:
        return _down(mlp, linear(x, gate_up, None, ops, rounded), ops)
    gate = linear(x, mlp.gate_proj.weight, mlp.gate_proj.bias, ops, rounded)
    up = linear(x, mlp.up_proj.weight, mlp.up_proj.bias, ops, rounded)
    down = mlp.down_proj
    return linear(gate_mul(ops, mlp, gate, up), down.weight, down.bias, ops)


def decode_step(
    model,
    kv: KVCache,
    token_ids: torch.Tensor,
    position: torch.Tensor,
    key_positions: torch.Tensor,
    ops: PointwiseOps = EAGER_OPS,
    moe_impl: str = "loop",
) -> torch.Tensor:
    """Logits [1, V] float32 for token_ids [1] at position [1]; writes that position's K/V.

    Attends over cache slots 0..len(key_positions)-1, masking those after `position`; the
    caller guarantees position < len(key_positions) <= kv.max_tokens. No host sync unless
    moe_impl is "loop" (or a layer splits_for_cpu). decode_step_segments with the host's
    work run inline.
    """
    segments = decode_step_segments(model, kv, token_ids, position, key_positions, ops,
                                    moe_impl)
    while True:
        try:
            work = next(segments)
        except StopIteration as done:
            return done.value
        work()


HostWork = Callable[[], None]


def splits_for_cpu(mlp, moe_impl: str) -> bool:
    """Whether a one-token step cuts at this MLP: a MoE layer over a partial cache whose
    misses the CPU computes (fast/moe_cpu_misses.py), on the slot-table kernels."""
    if not isinstance(mlp, SparseMoE) or moe_impl != "triton":
        return False
    layout = slot_layout(mlp)
    return layout is not None and layout.cpu_misses is not None


def _norm_moe_split(mlp, h, y, norm, ops: PointwiseOps, moe_impl: str, y_norm=None
                    ) -> Generator[HostWork, None, tuple[torch.Tensor, torch.Tensor]]:
    """_norm_mlp for a layer that splits_for_cpu, cut where the host works: after the
    router (yield the split: the CPU takes the misses) and after the hits' kernels (yield
    the join: the CPU's sum lands); then (h + y, the layer's output)."""
    rounds = ops.dense_kernels and takes_rounded_x(mlp, h, moe_impl)
    h, x, rounded = _norm_token(h, y, norm, ops, rounds, y_norm)
    layout = slot_layout(mlp)
    misses = layout.cpu_misses
    weights, ids = route_token(mlp, x, layout, ops.pdl)
    misses.stage(x, ids, weights)
    yield partial(misses.split, mlp)
    out = misses.hits(gpu_experts(mlp, x, layout, ops.pdl, rounded))
    yield misses.join
    routed = misses.combine(out, x.dtype)
    if mlp.shared_experts is not None:
        routed = routed + shared_expert(mlp.shared_experts, x, ops)
    return h, routed


def decode_step_segments(
    model, kv: KVCache, token_ids: torch.Tensor, position: torch.Tensor,
    key_positions: torch.Tensor, ops: PointwiseOps = EAGER_OPS, moe_impl: str = "triton",
) -> Generator[HostWork, None, torch.Tensor]:
    """decode_step cut at each MoE layer that splits_for_cpu: a generator that yields the
    host's work between the step's segments (run it, then resume) and returns the logits
    [1, V]. Between two yields nothing waits for the host, so each segment can be one CUDA
    graph (fast/split_runner.py); run with the work inline it is decode_step."""
    ropes = model.layer_ropes(position)
    h = model.embed(token_ids)  # [1, H]
    y = None
    y_norm = None
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        after_attn, before_mlp, after_mlp = block_norms(layer)
        h, (q, k, v) = _norm_qkv(attn, h, y, layer.input_layernorm, ops, y_norm)
        # Before the kernels' RoPE: scaling the rotated q is the same, RoPE being linear.
        q = attn.scale_queries(q, position)
        y = attention_decode(attn, q, k, v, position, key_positions, kv.k[i], kv.v[i],
                             *ropes[i], ops)
        if splits_for_cpu(layer.mlp, moe_impl):
            h, y = yield from _norm_moe_split(layer.mlp, h, y, before_mlp, ops, moe_impl,
                                              after_attn)
        else:
            h, y = _norm_mlp(layer.mlp, h, y, before_mlp, ops, moe_impl, after_attn)
        y_norm = after_mlp
    head = head_weight(model)
    _, x, rounded = _norm_token(h, y, model.model.norm, ops, _rounds_x(h, head, ops), y_norm)
    return project_head(x, model, ops.pdl, rounded)  # [1, V]
