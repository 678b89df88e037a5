"""Chunked prefill: large GEMMs per chunk, fused attention, logits for the last token only.

Same modules and weights as models/decoder.py (the numerical reference). A prompt runs in
chunks of `chunk_tokens` so activations stay bounded whatever its length; attention goes
through prefill_attention.py (flash / memory-efficient kernels, never [heads, T, S] scores);
MoE layers with resident experts take the sorted grouped path (moe_prefill.py). Only the last
token's hidden state is needed after the last layer's K/V are written, so the last layer of
the last chunk attends and runs its MLP for that one token, and the head sees one row.
GPT-OSS's layers, whose softmax also holds a sink logit that SDPA cannot take, attend through
kernels/sink_attention.py's Triton kernel (models/gpt_oss.sink_attention where Triton cannot
run).
"""

from __future__ import annotations

import torch

from strata.engine.core.fast.forward import block_norms, mlp_forward, project_head, qkv
from strata.engine.core.fast.pointwise import (
    EAGER_OPS,
    PointwiseOps,
    apply_add_norm,
    apply_norm,
    attention_scale,
    attention_sinks,
    attention_window,
)
from strata.engine.core.kernels import sink_attention as sink_kernel
from strata.engine.core.kernels.prefill_attention import flash_attention
from strata.engine.core.kv_cache import KVCache
from strata.engine.core.models.gpt_oss import sink_attention

# Fewer, larger chunks: a 4096-token MoE prefill in two chunks spent more time launching
# kernels than running them (H200 profile); 4096 rows keep activations near 0.5 GiB.
DEFAULT_PREFILL_CHUNK_TOKENS = 4096


def write_kv(attn, x, start_pos: int, k_cache, v_cache, cos, sin,
             ops: PointwiseOps = EAGER_OPS) -> torch.Tensor:
    """Project x [T, H], write its K/V at start_pos..start_pos+T-1; the queries [T, Hq, D]."""
    q, k, v = qkv(attn, x, cos, sin, ops)
    end_pos = start_pos + x.shape[0]
    k_cache[start_pos:end_pos] = k
    v_cache[start_pos:end_pos] = v
    return attn.scale_queries(q, range(start_pos, end_pos))


def attention_prefill(
    attn, x, start_pos: int, k_cache, v_cache, cos, sin, *, last_only: bool = False,
    ops: PointwiseOps = EAGER_OPS, full_chunk: bool = False,
) -> torch.Tensor:
    """A chunk's attention over the cached keys and itself; x [T, H] -> [T, H] ([1, H] last_only).

    Writes the chunk's K/V at start_pos..start_pos+T-1. last_only: attend for the last query.
    full_chunk: T is the prefill's chunk length, which recurs (cuDNN may take it).
    """
    end_pos = start_pos + x.shape[0]
    q = write_kv(attn, x, start_pos, k_cache, v_cache, cos, sin, ops)
    if last_only:
        q = q[-1:]  # [1, Hq, D]: one query sees every key up to itself
    keys = k_cache[:end_pos].transpose(0, 1).to(q.dtype)  # [Hkv, S, D]
    values = v_cache[:end_pos].transpose(0, 1).to(q.dtype)  # [Hkv, S, D]
    sinks = attention_sinks(attn)
    if sinks is not None and sink_kernel.is_usable(q.device):  # GPT-OSS: SDPA takes no sinks
        out = sink_kernel.fused_sink_attention(q.transpose(0, 1), keys, values, sinks,
                                               attention_window(attn), attention_scale(attn))
    elif sinks is not None:  # no Triton here: torch, by query blocks
        out = sink_attention(q.transpose(0, 1), keys, values, sinks, attention_window(attn))
    else:  # Gemma's own scale and window where the layer has them
        out = flash_attention(q.transpose(0, 1), keys, values, prefer_cudnn=full_chunk,
                              scale=attn.scale, window=attn.sliding_window)  # [Hq, T, D]
    return attn.o_proj(out.transpose(0, 1).reshape(q.shape[0], -1))


def _check(kv: KVCache, token_ids: torch.Tensor, start_pos: int, chunk_tokens: int) -> None:
    if token_ids.dim() != 1 or token_ids.numel() == 0:
        raise ValueError(f"token_ids must be a non-empty 1-D tensor, got {tuple(token_ids.shape)}")
    num_tokens = token_ids.shape[0]
    if start_pos < 0 or start_pos + num_tokens > kv.max_tokens:
        raise ValueError(
            f"positions {start_pos}..{start_pos + num_tokens - 1} do not fit the KV cache of "
            f"{kv.max_tokens} tokens: start a new sequence or use a larger context"
        )
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be positive, not {chunk_tokens}")


@torch.inference_mode()
def prefill(
    model,
    kv: KVCache,
    token_ids: torch.Tensor,
    start_pos: int,
    chunk_tokens: int = DEFAULT_PREFILL_CHUNK_TOKENS,
    moe_impl: str = "loop",
    ops: PointwiseOps = EAGER_OPS,
    last_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run token_ids [T] at start_pos.. in chunks; return the last token's logits [V] float32.

    Writes K/V for every position. Logits for the last token only spare a [T, vocab] float32
    tensor (2 GiB for 4k tokens of a 128k vocabulary). moe_impl "loop" keeps the reference
    MoE module; any other value takes the sorted grouped path where experts are resident.
    ops: the element-wise groups, eager or compiled with dynamic shapes (compiled.compiled_ops).
    last_index: a device tensor [1] naming the row whose logits are returned, for a prompt
    padded to a fixed length in one chunk (prefill_graph.py); rows after it only write K/V
    that later tokens overwrite, and causality keeps them out of the rows before.
    """
    _check(kv, token_ids, start_pos, chunk_tokens)
    if last_index is not None and token_ids.shape[0] > chunk_tokens:
        raise ValueError(f"a padded prompt must fit one chunk of {chunk_tokens} tokens, "
                         f"not {token_ids.shape[0]}")
    num_tokens = token_ids.shape[0]
    layers = model.model.layers
    for begin in range(0, num_tokens, chunk_tokens):
        chunk = token_ids[begin : begin + chunk_tokens]
        chunk_start = start_pos + begin
        is_last_chunk = begin + chunk_tokens >= num_tokens
        positions = torch.arange(chunk_start, chunk_start + chunk.shape[0], device=chunk.device)
        ropes = model.layer_ropes(positions)  # per layer: cos, sin [T, D] each
        h = model.embed(chunk)  # [T, H]
        x = apply_norm(ops, h, layers[0].input_layernorm)
        for i, layer in enumerate(layers):
            cos, sin = ropes[i]
            if i == len(layers) - 1 and not is_last_chunk:
                # Later chunks read only this layer's K/V: its attention and MLP feed nothing.
                write_kv(layer.self_attn, x, chunk_start, kv.k[i], kv.v[i], cos, sin, ops)
                break
            last_layer = i == len(layers) - 1  # of the last chunk: other chunks broke above
            # A padded prompt's last row is known only on the device: its last layer attends
            # for every row, then keeps that one.
            last_only = last_layer and last_index is None
            y = attention_prefill(layer.self_attn, x, chunk_start, kv.k[i], kv.v[i], cos, sin,
                                  last_only=last_only, ops=ops,
                                  full_chunk=chunk.shape[0] == chunk_tokens)
            if last_only:
                # The last row as a tensor of its own: a view's storage offset changes with
                # the chunk length, and compiled code specializes on it (a recompile per length).
                h = h[-1:].clone()
            elif last_layer:
                h, y = h.index_select(0, last_index), y.index_select(0, last_index)  # [1, H]
            after_attn, before_mlp, after_mlp = block_norms(layer)
            if after_attn is not None:  # Gemma's sandwich: the sublayer's output normed too
                y = apply_norm(ops, y, after_attn)
            h, x = apply_add_norm(ops, h, y, before_mlp)
            y = mlp_forward(layer.mlp, x, ops, moe_impl)
            if after_mlp is not None:
                y = apply_norm(ops, y, after_mlp)
            if i + 1 < len(layers):  # the residual add and the next layer's input norm
                h, x = apply_add_norm(ops, h, y, layers[i + 1].input_layernorm)
            else:  # the last chunk's last layer: only the last row needs the final norm
                _, x = apply_add_norm(ops, h, y, model.model.norm)  # [1, H] both
    return project_head(x[-1:], model)[0]  # [V]
