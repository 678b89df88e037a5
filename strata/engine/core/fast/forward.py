"""A decoder forward written for speed: a graph-capturable decode step and a chunked prefill.

Same modules and weights as models/decoder.py (the numerical reference), different schedule:

- `decode_step` takes the token and its position as device tensors, writes K/V with
  `index_copy_` and attends over a fixed number of key slots (the KV-length bucket) with a
  mask past the position. Nothing in it reads a value back to the host, so a CUDA graph
  captured once per bucket replays for every position inside that bucket.
- `prefill` runs a prompt in chunks and computes logits for the last token only. A chunk after
  cached tokens uses SDPA's lower-right causal bias instead of a [T, S] boolean mask: the mask
  forces SDPA's math backend, which builds [heads, T, S] scores, while the bias keeps the flash
  kernel (see torch.nn.attention.bias).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from strata.engine.core.fast.moe_grouped import moe_forward
from strata.engine.core.fast.pointwise import EAGER_OPS, PointwiseOps
from strata.engine.core.kv_cache import KVCache
from strata.engine.core.models.switch import SparseMoE

DEFAULT_PREFILL_CHUNK_TOKENS = 2048


def _head_weight(model) -> torch.Tensor:
    return model.model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight


def _qkv(attn, x: torch.Tensor, cos, sin, ops: PointwiseOps):
    num_tokens = x.shape[0]
    q = attn.q_proj(x).view(num_tokens, attn.num_heads, attn.head_dim)  # [T, Hq, D]
    k = attn.k_proj(x).view(num_tokens, attn.num_kv_heads, attn.head_dim)  # [T, Hkv, D]
    v = attn.v_proj(x).view(num_tokens, attn.num_kv_heads, attn.head_dim)  # [T, Hkv, D]
    q_norm = None if attn.q_norm is None else attn.q_norm.weight
    k_norm = None if attn.k_norm is None else attn.k_norm.weight
    eps = 0.0 if attn.q_norm is None else attn.q_norm.eps
    return ops.norm_rope(q, cos, sin, q_norm, eps), ops.norm_rope(k, cos, sin, k_norm, eps), v


def attention_decode(
    attn,
    x: torch.Tensor,
    position: torch.Tensor,
    key_positions: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    ops: PointwiseOps,
) -> torch.Tensor:
    """One token's attention over the first len(key_positions) cache slots; x [1, H]."""
    q, k, v = _qkv(attn, x, cos, sin, ops)
    k_cache.index_copy_(0, position, k.to(k_cache.dtype))
    v_cache.index_copy_(0, position, v.to(v_cache.dtype))
    num_keys = key_positions.shape[0]
    group = attn.num_heads // attn.num_kv_heads
    # GQA without repeating K/V: query head h uses kv head h // group, so [Hq, D] -> [Hkv, G, D].
    q_grouped = q.view(attn.num_kv_heads, group, attn.head_dim)
    keys = k_cache[:num_keys].to(q.dtype).permute(1, 2, 0)  # [Hkv, D, S]
    values = v_cache[:num_keys].to(q.dtype).permute(1, 0, 2)  # [Hkv, S, D]
    scores = torch.matmul(q_grouped, keys)  # [Hkv, G, S]
    probs = ops.masked_softmax(scores, key_positions, position, attn.head_dim**-0.5)
    out = torch.matmul(probs, values)  # [Hkv, G, D]
    return attn.o_proj(out.reshape(1, attn.num_heads * attn.head_dim))


def mlp_forward(mlp, x: torch.Tensor, ops: PointwiseOps, moe_impl: str) -> torch.Tensor:
    """The layer's feed-forward on x [T, H]: SwiGLU with fused activation, or the MoE path."""
    if isinstance(mlp, SparseMoE):
        return moe_forward(mlp, x, moe_impl)
    return mlp.down_proj(ops.silu_mul(mlp.gate_proj(x), mlp.up_proj(x)))


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
    moe_impl is "loop".
    """
    cos, sin = model.rope(position)  # [1, D] each
    h = model.model.embed_tokens(token_ids)  # [1, H]
    layers = model.model.layers
    first_norm = layers[0].input_layernorm
    x = ops.rms_norm(h, first_norm.weight, first_norm.eps)
    for i, layer in enumerate(layers):
        y = attention_decode(
            layer.self_attn, x, position, key_positions, kv.k[i], kv.v[i], cos, sin, ops
        )
        post = layer.post_attention_layernorm
        h, x = ops.add_rms_norm(h, y, post.weight, post.eps)
        y = mlp_forward(layer.mlp, x, ops, moe_impl)
        # The next norm is the next layer's input norm, or the final norm after the last layer.
        next_norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else model.model.norm
        h, x = ops.add_rms_norm(h, y, next_norm.weight, next_norm.eps)
    return F.linear(x, _head_weight(model)).float()  # [1, V]


def attention_prefill(attn, x, start_pos: int, k_cache, v_cache, cos, sin) -> torch.Tensor:
    """A chunk's attention over all cached keys and itself, without a materialized mask."""
    num_tokens = x.shape[0]
    end_pos = start_pos + num_tokens
    q, k, v = _qkv(attn, x, cos, sin, EAGER_OPS)
    k_cache[start_pos:end_pos] = k
    v_cache[start_pos:end_pos] = v
    keys = k_cache[:end_pos].transpose(0, 1).to(q.dtype)  # [Hkv, S, D]
    values = v_cache[:end_pos].transpose(0, 1).to(q.dtype)  # [Hkv, S, D]
    if num_tokens == 1:
        mask, is_causal = None, False  # one query sees every cached key
    elif start_pos == 0:
        mask, is_causal = None, True
    else:
        # Query i sits at start_pos + i: the causal diagonal is aligned bottom-right.
        mask, is_causal = causal_lower_right(num_tokens, end_pos), False
    out = _sdpa(q.transpose(0, 1), keys, values, mask, is_causal)  # [Hq, T, D]
    return attn.o_proj(out.transpose(0, 1).reshape(num_tokens, -1))


# Whether SDPA takes a lower-right causal bias with fewer K/V heads than query heads (GQA).
# The bias calls the flash kernel directly; if a torch build refuses GQA there, K/V heads are
# repeated instead (more bytes moved, still no [T, S] mask). Learned on first use.
_bias_takes_gqa: bool | None = None


def _sdpa(q, keys, values, mask, is_causal: bool) -> torch.Tensor:
    global _bias_takes_gqa
    is_gqa = q.shape[0] != keys.shape[0]
    if mask is None or not is_gqa or _bias_takes_gqa is not False:
        try:
            out = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, is_causal=is_causal, enable_gqa=is_gqa
            )
            if mask is not None and is_gqa:
                _bias_takes_gqa = True
            return out
        except RuntimeError:
            if mask is None or not is_gqa:
                raise
            _bias_takes_gqa = False
    group = q.shape[0] // keys.shape[0]
    keys = keys.repeat_interleave(group, dim=0)  # [Hq, S, D]
    values = values.repeat_interleave(group, dim=0)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)


@torch.inference_mode()
def prefill(
    model,
    kv: KVCache,
    token_ids: torch.Tensor,
    start_pos: int,
    chunk_tokens: int = DEFAULT_PREFILL_CHUNK_TOKENS,
    moe_impl: str = "loop",
) -> torch.Tensor:
    """Run token_ids [T] at start_pos.. in chunks; return the last token's logits [V] float32.

    Writes K/V for every position; logits are computed for the last token only, which spares
    a [T, vocab] float32 tensor (2 GiB for 4k tokens of a 128k vocabulary).
    """
    num_tokens = token_ids.shape[0]
    if token_ids.dim() != 1 or num_tokens == 0:
        raise ValueError(f"token_ids must be a non-empty 1-D tensor, got {tuple(token_ids.shape)}")
    if start_pos < 0 or start_pos + num_tokens > kv.max_tokens:
        raise ValueError(
            f"positions {start_pos}..{start_pos + num_tokens - 1} do not fit the KV cache of "
            f"{kv.max_tokens} tokens: start a new sequence or use a larger context"
        )
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be positive, not {chunk_tokens}")
    h = None
    for begin in range(0, num_tokens, chunk_tokens):
        chunk = token_ids[begin : begin + chunk_tokens]
        chunk_start = start_pos + begin
        positions = torch.arange(chunk_start, chunk_start + chunk.shape[0], device=chunk.device)
        cos, sin = model.rope(positions)  # [T, D] each
        h = model.model.embed_tokens(chunk)  # [T, H]
        for i, layer in enumerate(model.model.layers):
            x = layer.input_layernorm(h)
            h = h + attention_prefill(layer.self_attn, x, chunk_start, kv.k[i], kv.v[i], cos, sin)
            h = h + mlp_forward(layer.mlp, layer.post_attention_layernorm(h), EAGER_OPS, moe_impl)
    last = model.model.norm(h[-1:])  # [1, H]
    return F.linear(last, _head_weight(model)).float()[0]  # [V]
