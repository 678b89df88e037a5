"""Fused [q;k;v] and [gate;up] views over the weights arena (strata/engine/core/fused_views.py).

They must alias the parameters (no copy), stay out of state_dict, keep their addresses through
sleep/wake, give the unfused fast path's logits and the reference forward's, and be absent
(the unfused path runs) wherever the arena layout leaves a gap inside a group.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

# Must precede the first Triton import (see test_fast_paths.py).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from strata.engine.core import residency
from strata.engine.core.engine import Engine, EngineConfig
from strata.engine.core.fast.forward import decode_step
from strata.engine.core.fast.pointwise import EAGER_OPS, PointwiseOps
from strata.engine.core.fast.prefill import prefill
from strata.engine.core.fused_views import (
    adjacent_view,
    detach_fused_views,
    fused_gate_up,
    fused_qkv,
    fusion_order,
)
from strata.engine.core.kv_cache import KVCache
from strata.engine.core.memory.arena import Arena
from strata.engine.core.memory.cpu_mmap import CpuMmapBackend
from strata.engine.core.model_config import ModelConfig
from strata.engine.core.residency import ModelMemory
from strata.engine.core.weight_source import RandomWeights

# head_dim 32 with 2 kv heads: a k/v bias is 256 float32 bytes, so Qwen2's biases fuse too.
_COMMON = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 80, "num_hidden_layers": 2,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
                  "max_position_embeddings": 512}
CONFIGS = {
    "llama": ModelConfig(model_type="llama", **_COMMON),
    "qwen2": ModelConfig(model_type="qwen2", attention_bias=True, **_COMMON),
    "qwen3_moe": ModelConfig(model_type="qwen3_moe", num_experts=6, num_experts_per_tok=2,
                             moe_intermediate_size=24, mlp_only_layers=(0,), **_COMMON),
    # Sandwich norms whose post-sublayer norm runs before the fused GEMV's norm prologue,
    # GeGLU's activation in the down GEMV's, windows of 5 that the prompt of 19 cuts.
    "gemma3_text": ModelConfig(
        model_type="gemma3_text", sliding_window=5, query_pre_attn_scalar=24,
        final_logit_softcapping=30.0, rope_local_theta=10000.0,
        layer_types=("sliding_attention", "full_attention"), **_COMMON),
}
# head_dim 16: a k bias is 128 bytes, under the 256-byte alignment, so q/k/v biases are apart.
UNALIGNED_QWEN2 = ModelConfig(model_type="qwen2", attention_bias=True,
                              **{**_COMMON, "head_dim": 16})
PROMPT = [(7 * i + 3) % 96 for i in range(19)]


def _hf_config(name: str) -> dict:
    return {"model_type": name, **_COMMON}


@pytest.fixture
def arena_model():
    """build(config) -> a float32 model over CPU arenas (wide random weights); closed after."""
    memories = []

    def build(config: ModelConfig):
        memory = ModelMemory(CpuMmapBackend(), torch.float32)
        memories.append(memory)
        return memory.build(config, RandomWeights(torch.device("cpu"), std=0.15), "all")

    yield build
    for memory in memories:
        memory.close()


def test_fusion_order_groups_members_and_keeps_the_rest() -> None:
    attn, mlp = "model.layers.0.self_attn", "model.layers.0.mlp"
    names = [f"{attn}.q_proj.weight", f"{attn}.q_proj.bias", f"{attn}.k_proj.weight",
             f"{attn}.k_proj.bias", f"{attn}.v_proj.weight", f"{attn}.v_proj.bias",
             f"{attn}.o_proj.weight", f"{mlp}.gate_proj.weight", f"{mlp}.up_proj.weight",
             f"{mlp}.down_proj.weight", "model.layers.1.mlp.experts.gate_proj",
             "model.layers.1.mlp.experts.up_proj", "model.layers.1.self_attn.q_proj.weight"]
    assert fusion_order(names) == [
        f"{attn}.q_proj.weight", f"{attn}.k_proj.weight", f"{attn}.v_proj.weight",
        f"{attn}.q_proj.bias", f"{attn}.k_proj.bias", f"{attn}.v_proj.bias",
        f"{attn}.o_proj.weight", f"{mlp}.gate_proj.weight", f"{mlp}.up_proj.weight",
        f"{mlp}.down_proj.weight", "model.layers.1.mlp.experts.gate_proj",
        "model.layers.1.mlp.experts.up_proj",
        # An incomplete group (no k, v) stays where it was and is never fused.
        "model.layers.1.self_attn.q_proj.weight"]
    assert sorted(fusion_order(names)) == sorted(names)


def test_adjacent_view_checks_addresses() -> None:
    with Arena("t", 1 << 16, CpuMmapBackend()) as arena:
        arena.map()
        a = arena.allocate((4, 64), torch.float32)  # 1024 bytes: the next one follows at once
        b = arena.allocate((2, 64), torch.float32)
        fused = adjacent_view(arena, [a, b])
        assert fused.shape == (6, 64) and fused.data_ptr() == a.data_ptr()
        c = arena.allocate((1, 8), torch.float32)  # 32 bytes: a gap before the next one
        d = arena.allocate((1, 8), torch.float32, align_bytes=256)
        assert adjacent_view(arena, [c, d]) is None
        assert adjacent_view(arena, [b, a]) is None  # adjacent, but in the wrong order
        assert adjacent_view(arena, [a, torch.zeros(2, 64)]) is None  # not in the arena


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_engine_load_attaches_aliasing_views(name: str, tmp_path: Path) -> None:
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps(_hf_config(name)))
    engine = Engine(EngineConfig(model_path="random", random_weights=str(config_path),
                                 device="cpu", context_tokens=64,
                                 snapshot_dir=str(tmp_path / "snapshots")),
                    backend=CpuMmapBackend())
    engine.load()
    try:
        model = engine.model
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            weight, bias, sizes = fused_qkv(attn)
            projs = (attn.q_proj, attn.k_proj, attn.v_proj)
            assert sizes == (128, 64, 64) and weight.shape == (256, 64)
            assert weight.data_ptr() == attn.q_proj.weight.data_ptr()
            for part, proj in zip(weight.split(sizes), projs, strict=True):
                assert torch.equal(part, proj.weight)
            if name == "qwen2":
                assert bias.data_ptr() == attn.q_proj.bias.data_ptr()
                assert torch.equal(bias, torch.cat([p.bias for p in projs]))
            else:
                assert bias is None
            gate_up = fused_gate_up(mlp)
            assert gate_up.shape == (160, 64)
            assert gate_up.data_ptr() == mlp.gate_proj.weight.data_ptr()
            assert torch.equal(gate_up[80:], mlp.up_proj.weight)
        # Sleep and wake keep the views' addresses and bring their content back.
        before = {i: (layer.self_attn.qkv_weight.data_ptr(), layer.self_attn.qkv_weight.clone())
                  for i, layer in enumerate(model.model.layers)}
        engine.sleep()
        engine.wake()
        for i, layer in enumerate(model.model.layers):
            assert layer.self_attn.qkv_weight.data_ptr() == before[i][0]
            assert torch.equal(layer.self_attn.qkv_weight, before[i][1])
        # Plain attributes: no new parameters, buffers or state_dict entries.
        keys = set(model.state_dict()) | {n for n, _ in model.named_buffers()}
        assert not any("qkv" in k or "gate_up" in k for k in keys)
        assert {n for n, _ in model.named_parameters()} == set(model.state_dict())
        # Writing through one is visible in the other: the same memory, not a copy
        # (last: wake would restore the host copy over these writes).
        attn = model.model.layers[1].self_attn
        with torch.inference_mode():
            attn.qkv_weight[128, 3] = 123.0
            assert attn.k_proj.weight[0, 3] == 123.0
            model.model.layers[0].mlp.up_proj.weight[2, 5] = -7.0
            assert model.model.layers[0].mlp.gate_up_weight[82, 5] == -7.0
    finally:
        engine.close()


def test_moe_experts_are_not_fused(arena_model) -> None:
    model = arena_model(CONFIGS["qwen3_moe"])
    dense, sparse = model.model.layers[0].mlp, model.model.layers[1].mlp
    assert fused_gate_up(dense) is not None and fused_gate_up(sparse) is None
    assert not hasattr(sparse, "gate_up_weight")
    assert all(fused_qkv(layer.self_attn) is not None for layer in model.model.layers)


def _fast_logits(model, ops: PointwiseOps = EAGER_OPS) -> list[torch.Tensor]:
    """Chunked prefill (T > 1: strided q/k/v and gate/up views) then three decode steps."""
    max_tokens = 32
    kv = KVCache.for_config(model.config, max_tokens)
    tokens = [5, 17, 42]
    with torch.inference_mode():
        out = [prefill(model, kv, torch.tensor(PROMPT), 0, chunk_tokens=8)]
        for i, token in enumerate(tokens):
            position = torch.tensor([len(PROMPT) + i])
            out.append(decode_step(model, kv, torch.tensor([token]), position,
                                   torch.arange(max_tokens), ops, moe_impl="bmm")[0])
    return out


def _reference_logits(model) -> list[torch.Tensor]:
    kv = KVCache.for_config(model.config, 32)
    with torch.inference_mode():
        logits = model(torch.tensor([*PROMPT, 5, 17, 42]), 0, kv)
    return [logits[len(PROMPT) - 1 + i] for i in range(4)]


def _assert_all_close(got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fused_fast_path_matches_unfused_and_reference(name: str, arena_model) -> None:
    model = arena_model(CONFIGS[name])
    assert all(fused_qkv(layer.self_attn) is not None for layer in model.model.layers)
    fused = _fast_logits(model)
    detach_fused_views(model)
    assert all(fused_qkv(layer.self_attn) is None for layer in model.model.layers)
    _assert_all_close(fused, _fast_logits(model))
    _assert_all_close(fused, _reference_logits(model))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="Triton CPU interpreter not enabled")
def test_fused_views_feed_the_triton_decode_attention(arena_model) -> None:
    """The kernel reads q/k/v straight from the split [1, Nq+Nk+Nv] output (no copy at T=1)."""
    model = arena_model(CONFIGS["qwen2"])
    fused = _fast_logits(model, PointwiseOps(fused_attention=True))
    _assert_all_close(fused, _reference_logits(model))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="Triton CPU interpreter not enabled")
# qwen2 (biases) is left to test_fused_fast_path_matches_unfused_and_reference and the GPU
# tests: interpreted, each model here costs a minute of CI.
@pytest.mark.parametrize("name", ["llama", "qwen3_moe", "gemma3_text"])
def test_fused_views_take_the_norm_and_activation_into_the_gemvs(name, arena_model,
                                                                  monkeypatch) -> None:
    """With Triton projections, a fused q/k/v (gate/up) view's GEMV runs the norm before it,
    and the down projection SiLU·mul: the reference's logits, through the fused kernels."""
    from strata.engine.core.fast import decode_dense

    calls = {"norm_gemv": 0, "silu_mul_gemv": 0}

    def counted(fn):
        def call(*args, **kwargs):
            calls[fn.__name__] += 1
            return fn(*args, **kwargs)
        return call

    for fn in (decode_dense.norm_gemv, decode_dense.silu_mul_gemv):
        monkeypatch.setattr(decode_dense, fn.__name__, counted(fn))
    model = arena_model(CONFIGS[name])
    ops = PointwiseOps(fused_attention=True, dense_kernels=True)
    _assert_all_close(_fast_logits(model, ops), _reference_logits(model))
    dense_mlps = sum(fused_gate_up(layer.mlp) is not None for layer in model.model.layers)
    steps = 3  # _fast_logits' decode steps
    assert calls == {"norm_gemv": steps * (len(model.model.layers) + dense_mlps),
                     "silu_mul_gemv": steps * dense_mlps}


def test_unaligned_groups_fall_back_to_separate_projections(arena_model, monkeypatch) -> None:
    # 128-byte k/v biases leave gaps: no qkv view anywhere, gate/up still fused.
    model = arena_model(UNALIGNED_QWEN2)
    layers = model.model.layers
    assert all(getattr(layer.self_attn, "qkv_weight", "absent") is None for layer in layers)
    assert all(fused_gate_up(layer.mlp) is not None for layer in layers)
    _assert_all_close(_fast_logits(model), _reference_logits(model))
    # An alignment past every tensor's size leaves gaps everywhere: nothing fused, same output.
    monkeypatch.setattr(residency, "TENSOR_ALIGN_BYTES", 1 << 16)
    model = arena_model(CONFIGS["llama"])
    assert all(fused_qkv(layer.self_attn) is None and fused_gate_up(layer.mlp) is None
               for layer in model.model.layers)
    unfused = _fast_logits(model)
    _assert_all_close(unfused, _reference_logits(model))
    monkeypatch.undo()
    aligned = arena_model(CONFIGS["llama"])  # same seeds: the same weights, now fused
    assert fused_qkv(aligned.model.layers[0].self_attn) is not None
    _assert_all_close(_fast_logits(aligned), unfused)


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_fuse_by_copy_gives_torch_models_the_same_views(name: str) -> None:
    from strata.engine.core.fused_views import fuse_by_copy
    from strata.engine.core.random_weights import build_random_model

    model = build_random_model(CONFIGS[name], "cpu", torch.float32, seed=3, std=0.15)
    unfused = _fast_logits(model)
    assert fuse_by_copy(model) == {"qkv": 2, "gate_up": 2}
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    weight, bias, sizes = fused_qkv(attn)
    assert attn.q_proj.weight.data_ptr() == weight.data_ptr()
    assert attn.v_proj.weight.data_ptr() == weight[sizes[0] + sizes[1]:].data_ptr()
    assert (bias is not None) == (name == "qwen2")
    assert mlp.up_proj.weight.data_ptr() == fused_gate_up(mlp)[mlp.gate_proj.weight.shape[0]:].data_ptr()
    _assert_all_close(_fast_logits(model), unfused)
    _assert_all_close(_fast_logits(model), _reference_logits(model))
