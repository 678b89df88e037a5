"""The fused sink prefill attention (kernels/sink_attention.py) compiled for the GPU, at
gpt-oss-20b's attention shape (64 query heads over 8 kv heads, head_dim 64, windows of 128 on
alternate layers), in bf16 with its tensor-core dots (the CPU tests upcast them under the
interpreter), against the torch sink_attention; and the fast prefill taking it. Times nothing."""

from __future__ import annotations

import importlib

import pytest
import torch

from strata.engine.core.kernels.sink_attention import fused_sink_attention
from strata.engine.core.models.gpt_oss import sink_attention

pytestmark = pytest.mark.gpu

HEADS, KV_HEADS, HEAD_DIM = 64, 8, 64


def _inputs(num_tokens: int, num_keys: int, seed: int = 0):
    """q [Hq, T, D] and keys/values [Hkv, S, D] laid out as attention_prefill passes them
    (transposed views of [T, Hq, D] and of a [S, Hkv, D] cache), bf16; sinks float32."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rows(n: int, heads: int) -> torch.Tensor:
        return torch.randn(n, heads, HEAD_DIM, generator=gen, device="cuda").bfloat16()

    q, k_cache, v_cache = rows(num_tokens, HEADS), rows(num_keys, KV_HEADS), rows(num_keys,
                                                                                 KV_HEADS)
    sinks = torch.randn(HEADS, generator=gen, device="cuda") * 2
    return q.transpose(0, 1), k_cache.transpose(0, 1), v_cache.transpose(0, 1), sinks


@pytest.mark.parametrize("window", [0, 128])
@pytest.mark.parametrize("num_tokens", [512, 2048])
@pytest.mark.parametrize("cached", [0, 512])
def test_matches_the_torch_sink_attention_at_gpt_oss_20b_shape(num_tokens, cached, window):
    """No further from the float32 result than the torch path in bf16 (plus bf16's rounding of
    the output): a first chunk (S == T) and a second one after 512 cached keys."""
    q, keys, values, sinks = _inputs(num_tokens, num_tokens + cached)
    with torch.inference_mode():
        got = fused_sink_attention(q, keys, values, sinks, window)
        torch_bf16 = sink_attention(q, keys, values, sinks, window)
        exact = sink_attention(q.float(), keys.float(), values.float(), sinks, window)
    assert got.shape == (HEADS, num_tokens, HEAD_DIM) and got.dtype == torch.bfloat16
    assert torch.isfinite(got).all()
    error = (got.float() - exact).abs().max().item()
    torch_error = (torch_bf16.float() - exact).abs().max().item()
    assert error <= 2 * torch_error + 1e-2, (error, torch_error)
    torch.testing.assert_close(got.float(), torch_bf16.float(), rtol=3e-2, atol=3e-2)


def test_fast_prefill_takes_the_kernel_and_tracks_the_reference_on_cuda(monkeypatch) -> None:
    """A GPT-OSS layer at gpt-oss-20b's attention shape through attention_prefill (a 2048-token
    chunk after 512 cached ones, both windows): the kernel runs, never the torch path, and the
    output tracks the layer's own (torch) attention."""
    from strata.engine.core.model_config import ModelConfig
    from strata.engine.core.random_weights import build_random_model

    prefill_module = importlib.import_module("strata.engine.core.fast.prefill")

    def refuse(*args, **kwargs):
        raise AssertionError("the torch sink attention ran on CUDA")

    config = ModelConfig(model_type="gpt_oss", vocab_size=256, hidden_size=512,
                         intermediate_size=256, num_hidden_layers=2, num_attention_heads=HEADS,
                         num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, num_experts=4,
                         num_experts_per_tok=2, moe_intermediate_size=256, sliding_window=128,
                         attention_bias=True)
    model = build_random_model(config, "cuda", torch.bfloat16, seed=0, std=0.05)
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(2560, config.hidden_size, generator=gen, device="cuda").bfloat16()
    positions = torch.arange(2560, device="cuda")
    windows = []
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        windows.append(attn.sliding_window or 0)
        cos, sin = model.layer_ropes(positions)[i]
        k_cache, v_cache = (torch.zeros(2560, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16,
                                        device="cuda") for _ in range(2))
        with torch.inference_mode():
            prefill_module.attention_prefill(attn, x[:512], 0, k_cache, v_cache, cos[:512],
                                             sin[:512])
            with monkeypatch.context() as patch:
                patch.setattr(prefill_module, "sink_attention", refuse)
                got = prefill_module.attention_prefill(attn, x[512:], 512, k_cache, v_cache,
                                                       cos[512:], sin[512:])
            q = prefill_module.write_kv(attn, x[512:], 512, k_cache, v_cache, cos[512:],
                                        sin[512:])
            expected = attn.o_proj(attn._attend(q, k_cache, v_cache, 2560).transpose(0, 1)
                                   .reshape(2048, -1))
        torch.testing.assert_close(got.float(), expected.float(), rtol=3e-2, atol=3e-2)
    assert sorted(windows) == [0, 128]
