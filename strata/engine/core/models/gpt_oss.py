"""GPT-OSS (OpenAI's gpt-oss-20b/120b): attention with sinks and biases, sliding-window
attention on alternating layers, YaRN RoPE (layers.py), and a sparse MoE in every layer with
a biased router, softmax over the top-4 logits and biased experts with a clamped SwiGLU.

Attention sinks: each query head has a learned logit that joins the softmax denominator and
attends to nothing, so a head can put weight "nowhere". The CUDA fast paths have no such
kernel (fast_coverage.py sends this model to this reference path).

Checkpoint layouts handled by `sanitize`:
- transformers (save_pretrained): experts.gate_up_proj [E, H, 2I] with gate and up
  interleaved along 2I (gate at even columns), gate_up_proj_bias [E, 2I], down_proj [E, I, H],
  down_proj_bias [E, H] (the experts multiply x @ W, hence the transposes);
- OpenAI's release: the same matrices as MXFP4 `*_blocks` [E, N, K/32, 16] and `*_scales`
  [E, N, K/32] (loader/mxfp4_hf.py turns them into GGML MXFP4 blocks);
- GGUF (llama.cpp): gate and up already split, biases as `ffn_*_exps.bias`, handled by the
  name map (loader/gguf_names.py).
"""

from __future__ import annotations

import math
import re

import torch
import torch.nn.functional as F
from torch import nn

from strata.engine.core.loader.lazy import DeferredTensor, LazyTensor
from strata.engine.core.model_config import ModelConfig, ModelFormatError
from strata.engine.core.models.decoder import DecoderLM, drop_unused_tensors
from strata.engine.core.models.layers import Attention
from strata.engine.core.models.switch import ExpertActivation, SparseMoE

SLIDING = "sliding_attention"
QUERY_CHUNK = 256  # queries per score block: bounds the [heads, queries, keys] scores


def layer_window(config: ModelConfig, layer_idx: int) -> int:
    """The layer's attention window in positions (0: attends over everything before it).
    Without layer_types, gpt-oss alternates: even layers slide (what llama.cpp assumes)."""
    if config.layer_types:
        if len(config.layer_types) != config.num_hidden_layers:
            raise ModelFormatError(
                f"layer_types has {len(config.layer_types)} entries for "
                f"{config.num_hidden_layers} layers: the config is inconsistent")
        is_sliding = config.layer_types[layer_idx] == SLIDING
    else:
        is_sliding = layer_idx % 2 == 0
    return (config.sliding_window or 0) if is_sliding else 0


def sink_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   sinks: torch.Tensor, window: int) -> torch.Tensor:
    """Causal attention of q [Hq, T, D] (the last T of S positions) over keys/values
    [Hkv, S, D], each head's softmax denominator also holding exp(sinks[h]); a query at
    position p sees keys p - window + 1 .. p when window > 0. Returns [Hq, T, D]."""
    num_heads, num_tokens, head_dim = q.shape
    num_keys = keys.shape[1]
    group = num_heads // keys.shape[0]
    scale = 1.0 / math.sqrt(head_dim)
    out = torch.empty_like(q)
    for t0 in range(0, num_tokens, QUERY_CHUNK):
        t1 = min(num_tokens, t0 + QUERY_CHUNK)
        first_pos, last_pos = num_keys - num_tokens + t0, num_keys - num_tokens + t1 - 1
        k0 = max(0, first_pos - window + 1) if window else 0
        k = keys[:, k0 : last_pos + 1].repeat_interleave(group, dim=0)  # [Hq, S', D]
        v = values[:, k0 : last_pos + 1].repeat_interleave(group, dim=0)
        scores = torch.matmul(q[:, t0:t1].float(), k.float().transpose(1, 2)) * scale
        q_pos = torch.arange(first_pos, last_pos + 1, device=q.device)[:, None]
        k_pos = torch.arange(k0, last_pos + 1, device=q.device)[None, :]
        allowed = k_pos <= q_pos
        if window:
            allowed &= k_pos > q_pos - window
        scores = scores.masked_fill(~allowed, float("-inf"))  # [Hq, t, S']
        sink = sinks.float()[:, None, None].expand(-1, t1 - t0, 1)
        probs = F.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
        out[:, t0:t1] = torch.matmul(probs.to(v.dtype), v)
    return out


class GptOssAttention(Attention):
    """GQA with q/k/v/o biases, per-head sinks and an optional sliding window."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__(config, config.attention_bias, config.attention_bias, qk_norm=False,
                         sliding_window=layer_window(config, layer_idx) or None)
        self.sinks = nn.Parameter(torch.empty(config.num_attention_heads))

    def _attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                end_pos: int) -> torch.Tensor:
        keys = k_cache[:end_pos].transpose(0, 1).to(q.dtype)  # [Hkv, S, D]
        values = v_cache[:end_pos].transpose(0, 1).to(q.dtype)
        return sink_attention(q.transpose(0, 1), keys, values, self.sinks,
                              self.sliding_window or 0)


class Model(DecoderLM):
    def __init__(self, config: ModelConfig):
        super().__init__(
            config,
            make_attention=lambda i: GptOssAttention(config, i),
            make_mlp=lambda i: SparseMoE(
                config.hidden_size,
                config.moe_intermediate_size,
                config.num_experts,
                config.num_experts_per_tok,
                norm_topk_prob=False,
                router_bias=True,
                expert_bias=True,
                softmax_after_topk=True,
                activation=ExpertActivation(config.swiglu_limit, config.swiglu_alpha),
            ),
        )


_FUSED = re.compile(r"^(model\.layers\.\d+\.mlp)\.experts\.(gate_up_proj|down_proj)(_bias)?$")


def _deferred(source: LazyTensor, shape: tuple[int, ...], pick) -> DeferredTensor:
    return DeferredTensor(shape, source.dtype, lambda: pick(source.read()))


def sanitize(tensors: dict[str, LazyTensor], config: ModelConfig) -> dict[str, LazyTensor]:
    """transformers' fused, transposed, interleaved experts -> canonical stacked gate/up [E, I,
    H] and down [E, H, I], biases -> mlp.expert_bias.{gate,up,down}; MXFP4 blocks+scales ->
    GGML MXFP4 experts (kept quantized where the device keeps blocks)."""
    from strata.engine.core.loader.mxfp4_hf import gather_mxfp4_experts

    tensors = gather_mxfp4_experts(tensors)
    # A canonical down_proj (GGUF, or the MXFP4 form above) is already [E, H, I]; only a layer
    # in transformers' layout (fused gate_up) has its down_proj transposed [E, I, H].
    fused_layers = {m.group(1) for n in tensors
                    if (m := _FUSED.match(n)) and m.group(2) == "gate_up_proj" and not m.group(3)}
    for name in list(tensors):
        match = _FUSED.match(name)
        if match is None or (match.group(1) not in fused_layers and not match.group(3)):
            continue
        prefix, kind, is_bias = match.groups()
        fused = tensors.pop(name)
        shape = tuple(fused.shape)
        if is_bias and kind == "gate_up_proj":  # [E, 2I], gate at even columns
            half = (shape[0], shape[1] // 2)
            tensors[f"{prefix}.expert_bias.gate"] = _deferred(fused, half, lambda t: t[:, 0::2])
            tensors[f"{prefix}.expert_bias.up"] = _deferred(fused, half, lambda t: t[:, 1::2])
        elif is_bias:
            tensors[f"{prefix}.expert_bias.down"] = fused
        elif kind == "gate_up_proj":  # [E, H, 2I] -> two [E, I, H]
            half = (shape[0], shape[2] // 2, shape[1])
            tensors[f"{prefix}.experts.gate_proj"] = _deferred(
                fused, half, lambda t: t[:, :, 0::2].transpose(1, 2))
            tensors[f"{prefix}.experts.up_proj"] = _deferred(
                fused, half, lambda t: t[:, :, 1::2].transpose(1, 2))
        else:  # down [E, I, H] -> [E, H, I]
            tensors[f"{prefix}.experts.down_proj"] = _deferred(
                fused, (shape[0], shape[2], shape[1]), lambda t: t.transpose(1, 2))
    return drop_unused_tensors(tensors, config)
