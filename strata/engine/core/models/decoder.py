"""The decoder-only transformer every supported architecture shares.

An architecture file only says which attention and MLP each layer gets and how its tensor
names map onto the canonical (Hugging Face) ones; the skeleton and forward live here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from strata.engine.core.kv_cache import KVCache, check_positions
from strata.engine.core.model_config import ModelConfig
from strata.engine.core.models.layers import Attention, RMSNorm, RotaryEmbedding
from strata.engine.core.quant.weight import apply_linear


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: ModelConfig, attention: Attention, mlp: nn.Module,
                 norm: type[RMSNorm] = RMSNorm):
        super().__init__()
        self.self_attn = attention
        self.mlp = mlp
        self.input_layernorm = norm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = norm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h, start_pos, k_cache, v_cache, cos, sin) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), start_pos, k_cache, v_cache, cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))

    def decode_batch(self, h, positions, k_caches, v_caches, cos, sin) -> torch.Tensor:
        """One token of each of B sequences: h [B, H]; attention per sequence (layers.py)."""
        h = h + self.self_attn.decode_batch(self.input_layernorm(h), positions, k_caches,
                                            v_caches, cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


class SandwichDecoderLayer(DecoderLayer):
    """Gemma 2/3's block: each sublayer's output is normed too before the residual add,
    x + post_attn(attn(input(x))), then x + post_ff(mlp(pre_ff(x)))."""

    def __init__(self, config: ModelConfig, attention: Attention, mlp: nn.Module,
                 norm: type[RMSNorm] = RMSNorm):
        super().__init__(config, attention, mlp, norm)
        self.pre_feedforward_layernorm = norm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = norm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h, start_pos, k_cache, v_cache, cos, sin) -> torch.Tensor:
        y = self.self_attn(self.input_layernorm(h), start_pos, k_cache, v_cache, cos, sin)
        h = h + self.post_attention_layernorm(y)
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))

    def decode_batch(self, h, positions, k_caches, v_caches, cos, sin) -> torch.Tensor:
        y = self.self_attn.decode_batch(self.input_layernorm(h), positions, k_caches, v_caches,
                                        cos, sin)
        h = h + self.post_attention_layernorm(y)
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class DecoderBody(nn.Module):
    """Holds what sits under `model.` in the tensor names: embeddings, layers, final norm."""

    def __init__(self, config: ModelConfig, layers: list[DecoderLayer],
                 norm: type[RMSNorm] = RMSNorm):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = norm(config.hidden_size, config.rms_norm_eps)


class DecoderLM(nn.Module):
    """A causal language model; parameter names are the canonical Hugging Face names.

    An architecture may pick the layer class and the norm class, and override `embed` (the
    embedding lookup) and `layer_ropes` (which RoPE table each layer reads)."""

    def __init__(
        self,
        config: ModelConfig,
        make_attention: Callable[[int], Attention],
        make_mlp: Callable[[int], nn.Module],
        layer_class: type[DecoderLayer] = DecoderLayer,
        norm: type[RMSNorm] = RMSNorm,
    ):
        super().__init__()
        self.config = config
        layers = [
            layer_class(config, make_attention(i), make_mlp(i), norm)
            for i in range(config.num_hidden_layers)
        ]
        self.model = DecoderBody(config, layers, norm)
        # Tied models read the output projection from the embedding table: no lm_head tensor.
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self.rope = RotaryEmbedding(config)

    def forward(
        self, input_ids: torch.Tensor, start_pos: int, kv: KVCache, last_only: bool = False
    ) -> torch.Tensor:
        """Logits [T, vocab] (float32) for input_ids [T] placed at start_pos..start_pos+T-1.

        Writes those positions' K/V into `kv` and attends over positions 0..start_pos+T-1;
        the caller guarantees positions before start_pos hold this sequence's K/V. With
        last_only, only the last position's logits are computed ([1, vocab]): a prefill needs
        no more, and the vocabulary projection is the largest matmul of a small model.
        """
        if input_ids.dim() != 1 or input_ids.numel() == 0:
            raise ValueError(
                f"input_ids must be a non-empty 1-D tensor, got {tuple(input_ids.shape)}"
            )
        num_tokens = input_ids.shape[0]
        if start_pos < 0 or start_pos + num_tokens > kv.max_tokens:
            raise ValueError(
                f"positions {start_pos}..{start_pos + num_tokens - 1} do not fit the KV cache of "
                f"{kv.max_tokens} tokens: start a new sequence or use a larger context"
            )
        positions = torch.arange(start_pos, start_pos + num_tokens, device=input_ids.device)
        ropes = self.layer_ropes(positions)  # per layer: cos, sin [T, D] each
        h = self.embed(input_ids)  # [T, H]
        for i, layer in enumerate(self.model.layers):
            h = layer(h, start_pos, kv.k[i], kv.v[i], *ropes[i])
        if last_only:
            h = h[-1:]
        return self._logits(h)

    def forward_decode_batch(
        self, input_ids: torch.Tensor, positions: Sequence[int], kvs: Sequence[KVCache]
    ) -> torch.Tensor:
        """Logits [B, vocab] (float32) for one new token of each of B sequences.

        input_ids [B]: sequence b's token goes to position positions[b] of its own cache
        kvs[b], whose positions before it hold that sequence's K/V. The linear, norm and MLP
        (or MoE) layers run on all B rows at once; attention runs per sequence.
        """
        if input_ids.dim() != 1 or input_ids.shape[0] != len(positions) or \
                len(positions) != len(kvs) or not kvs:
            raise ValueError(f"a batched decode step needs one token, position and KV cache per "
                             f"sequence, got {tuple(input_ids.shape)}, {len(positions)}, {len(kvs)}")
        check_positions(positions, kvs)
        # LongRoPE picks its factors per row here, as each sequence's own call would.
        ropes = self.layer_ropes(torch.tensor(list(positions), device=input_ids.device),
                                 per_row=True)
        h = self.embed(input_ids)  # [B, H]
        for i, layer in enumerate(self.model.layers):
            h = layer.decode_batch(h, positions, [kv.k[i] for kv in kvs],
                                   [kv.v[i] for kv in kvs], *ropes[i])
        return self._logits(h)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embeddings of input_ids [T]: [T, H]."""
        return self.model.embed_tokens(input_ids)

    def layer_ropes(self, positions: torch.Tensor, per_row: bool = False
                    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(cos, sin) [T, D] each for every layer: one table shared by all of them here.
        per_row: positions are B sequences' single tokens (RotaryEmbedding.forward)."""
        cos_sin = self.rope(positions, per_row=per_row)
        return [cos_sin] * len(self.model.layers)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm and vocabulary projection: h [T, H] -> logits [T, V] float32, tanh
        soft-capped where the config says (Gemma)."""
        h = self.model.norm(h)
        head = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = apply_linear(h, head).float()  # [T, V]
        cap = self.config.final_logit_softcapping
        return logits if not cap else torch.tanh(logits / cap) * cap


def drop_unused_tensors(tensors: dict, config: ModelConfig) -> dict:
    """Remove tensors that files carry but the model derives: RoPE tables, a tied lm_head."""
    for name in [n for n in tensors if n.endswith("rotary_emb.inv_freq")]:
        del tensors[name]
    if config.tie_word_embeddings:
        # Some exporters write the tied head out anyway; it duplicates the embedding table.
        tensors.pop("lm_head.weight", None)
    return tensors
