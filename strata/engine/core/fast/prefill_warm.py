"""Warm-up prefills: one short prefill into a scratch cache, which compiles the element-wise
groups it calls, and cuDNN's plan for a full chunk's attention. What tuning.warm_up_prefill
runs at a load and deferred_compile.py runs after one."""

from __future__ import annotations

import torch

from strata.engine.core.fast.pointwise import PointwiseOps
from strata.engine.core.fast.prefill_runner import PrefillRunner
from strata.engine.core.kernels.prefill_attention import flash_attention
from strata.engine.core.kv_cache import KVCache


@torch.inference_mode()
def warm_prefill_pass(prefiller: PrefillRunner, ops: PointwiseOps, num_tokens: int = 23) -> None:
    """One prefill of num_tokens (see warm_up_prefill) with ops, into a scratch cache: what
    compiles ops' groups, if compiled."""
    model, device = prefiller.model, prefiller.device
    config = model.config
    dtype = next(model.parameters()).dtype
    kv = KVCache.for_config(config, num_tokens, dtype, device)
    ids = torch.arange(num_tokens, device=device) % config.vocab_size
    called_ops, prefiller.ops = prefiller.ops, ops
    try:
        prefiller.called(kv, ids, 0)
    finally:
        prefiller.ops = called_ops


@torch.inference_mode()
def warm_cudnn_plan(prefiller: PrefillRunner) -> None:
    """On CUDA, build cuDNN's plan for a full chunk's attention (it builds one per new
    length); nothing elsewhere."""
    model, device = prefiller.model, prefiller.device
    if device.type != "cuda":
        return
    dtype = next(model.parameters()).dtype
    attn = model.model.layers[0].self_attn
    chunk, head_dim = prefiller.chunk_tokens, attn.head_dim

    # Laid out as attention_prefill passes them ([T, heads, D] transposed), in case
    # cuDNN keys its plans on strides as well as shapes.
    def rows(num_heads: int) -> torch.Tensor:
        return torch.zeros(chunk, num_heads, head_dim, dtype=dtype,
                           device=device).transpose(0, 1)

    keys = rows(attn.num_kv_heads)
    flash_attention(rows(attn.num_heads), keys, keys, prefer_cudnn=True)
    torch.cuda.synchronize(device)
