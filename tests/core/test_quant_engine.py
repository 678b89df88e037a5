"""Quantized GGUF weights through the real engine: blocks kept in the weights arena and read
by the Triton kernels (CPU interpreter, STRATA_QUANTIZED=1) decode greedily exactly like the
dequantized path (STRATA_QUANTIZED=0) on tiny random models, through the reference forward,
the fast path's schedule, and a sleep/wake round trip from the host copy.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch

# Must precede the first Triton import: triton.jit picks the interpreter at decoration time.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="Triton CPU interpreter not enabled"
)

from strata.engine.core.engine import Engine, EngineConfig
from strata.engine.core.fast import GraphDecoder
from strata.engine.core.kv_cache import KVCache
from strata.engine.core.models.layers import SwiGLU
from strata.engine.core.quant.weight import (
    QuantizedEmbedding,
    QuantizedLinear,
    QuantizedWeight,
    warm_up_quantized,
)
from strata.engine.protocol import SamplingSpec
from tests.helpers.dp4a_switch import assert_dp4a_matches_planes
from tests.helpers.gguf_writer import write_gguf_from_hf
from tests.helpers.tiny_models import make_tiny_hf_config

PROMPT = [(7 * i + 3) % 300 for i in range(23)]  # > 16 tokens: the prefill's dequantize path
NUM_NEW = 12


def _gguf(tmp_path, variant: str, qtype: str, overrides: dict[str, str] | None = None):
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        make_tiny_hf_config(variant), dtype=torch.float32).eval()
    return write_gguf_from_hf(model, None, tmp_path / f"{variant}.gguf", qtype,
                              qtype_overrides=overrides)


def _engine(path, monkeypatch, quantized: bool) -> Engine:
    monkeypatch.setenv("STRATA_QUANTIZED", "1" if quantized else "0")
    engine = Engine(EngineConfig(model_path=str(path), device="cpu", context_tokens=64,
                                 snapshot_ram_budget_bytes=1 << 20))
    engine.load()
    return engine


def _greedy(engine: Engine) -> list[int]:
    spec = SamplingSpec(max_tokens=NUM_NEW, temperature=0.0)
    return [t for step in engine.generate(PROMPT, spec) for t in step]


def _dequantized_run(path, monkeypatch) -> tuple[list[int], int]:
    engine = _engine(path, monkeypatch, quantized=False)
    try:
        return _greedy(engine), engine.memory.weights.allocated_bytes
    finally:
        engine.close()


@pytest.mark.parametrize(("variant", "qtype", "overrides"), [
    ("llama", "Q8_0", None),
    # Mixed types in one layer, as Q4_K_M files have: layer 0's v cannot fuse with q and k.
    ("smollm2", "Q4_0", {"blk.0.attn_v.weight": "Q5_0", "blk.1.ffn_down.weight": "Q8_0"}),
    # Gemma 3 QAT files are Q4_0: its reference forward (the fast path stands aside) reads
    # the blocks through the same kernels.
    ("gemma3", "Q4_0", None),
    # Phi-4-mini's shape: fused attn_qkv / ffn_up blocks split by rows (partial RoPE also
    # reorders q/k rows), then fused again by the arena.
    ("phi3_partial_longrope", "Q8_0", None),
])
def test_quantized_engine_decodes_like_the_dequantized_one(tmp_path, monkeypatch, variant,
                                                           qtype, overrides) -> None:
    path = _gguf(tmp_path, variant, qtype, overrides)
    expected, float_bytes = _dequantized_run(path, monkeypatch)
    engine = _engine(path, monkeypatch, quantized=True)
    try:
        attn = engine.model.model.layers[0].self_attn
        assert isinstance(attn.q_proj, QuantizedLinear)
        assert isinstance(engine.model.model.embed_tokens, QuantizedEmbedding)
        # Blocks, not floats: Q8_0 is 34 bytes per 32 values against 128 in float32.
        assert engine.memory.weights.allocated_bytes < float_bytes / 2.5
        fused = [layer.self_attn.qkv_weight for layer in engine.model.model.layers]
        if overrides:
            assert fused[0] is None and isinstance(fused[1], QuantizedWeight)
        else:
            assert all(isinstance(w, QuantizedWeight) for w in fused)
            # SwiGLU's gate and up fuse in the arena (Gemma's GeGLU keeps its own two).
            assert all(isinstance(layer.mlp.gate_up_weight, QuantizedWeight)
                       for layer in engine.model.model.layers
                       if isinstance(layer.mlp, SwiGLU))
        assert _greedy(engine) == expected
        # The host copy was filled from the file: it equals the arena byte for byte, and
        # sleep/wake restores blocks that decode the same.
        host = engine.memory.weights.host_copy
        assert host.count_differing_chunks(engine.memory.weights) == 0
        engine.sleep()
        engine.wake()
        assert _greedy(engine) == expected
    finally:
        engine.close()


@pytest.mark.parametrize("dense_kernels", [False, True])
def test_fast_schedule_on_quantized_weights_matches_the_reference(tmp_path, monkeypatch,
                                                                  dense_kernels) -> None:
    """GraphDecoder's decode_step and chunked prefill (what CUDA runs, here eager) over blocks:
    fused q/k/v views, the head and the embedding take the quantized branch."""
    path = _gguf(tmp_path, "llama", "Q8_0")
    engine = _engine(path, monkeypatch, quantized=True)
    try:
        expected = _greedy(engine)
        if not dense_kernels:
            # What CUDA compiles before capturing graphs: q/o [64, 64], k/v [32, 64], gate/up
            # [96, 64], down [64, 96], embedding and head [320, 64], fused qkv [128, 64] and
            # gate_up [192, 64]: 7 distinct variants.
            assert warm_up_quantized(engine.model) == 7
        decoder = GraphDecoder(engine.model, use_cuda_graphs=False, compile_pointwise=False,
                               dense_kernels=dense_kernels, min_bucket_tokens=16,
                               prefill_chunk_tokens=20)
        assert decoder.ops.dense_kernels == dense_kernels
        kv = KVCache.for_config(engine.model.config, 64)
        spec = SamplingSpec(max_tokens=NUM_NEW, temperature=0.0)
        assert list(decoder.generate(kv, PROMPT, spec, max_new_tokens=NUM_NEW)) == expected
    finally:
        engine.close()


def test_fast_schedule_on_quantized_phi3_matches_the_reference(tmp_path, monkeypatch) -> None:
    """Phi-4-mini's shape (partial RoPE, LongRoPE) through GraphDecoder over Q8_0 blocks:
    the fast kernels take the model's cos/sin tables, whose passed-through dims rotate by 0."""
    path = _gguf(tmp_path, "phi3_partial_longrope", "Q8_0")
    engine = _engine(path, monkeypatch, quantized=True)
    try:
        assert engine.model_config.rotary_dim < engine.model_config.head_dim
        expected = _greedy(engine)
        decoder = GraphDecoder(engine.model, use_cuda_graphs=False, compile_pointwise=False,
                               dense_kernels=True, min_bucket_tokens=16,
                               prefill_chunk_tokens=20)
        kv = KVCache.for_config(engine.model.config, 64)
        spec = SamplingSpec(max_tokens=NUM_NEW, temperature=0.0)
        assert list(decoder.generate(kv, PROMPT, spec, max_new_tokens=NUM_NEW)) == expected
    finally:
        engine.close()


def test_q_k_v_of_two_types_decode_in_one_launch_like_three(tmp_path, monkeypatch) -> None:
    """bf16 compute (as on a GPU), the Q4_K_M-like Llama: layer 0's q and k are Q4_K and its
    v Q6_K, so the arena's q/k/v form a pair (one dp4a launch for one token), while layer
    1's all-Q4_K q/k/v fuse as one weight. GraphDecoder's greedy tokens (graphs off: the
    step a CUDA graph captures) equal those of the three separate products."""
    from strata.engine.core import engine as engine_module
    from strata.engine.core.quant import gemv_dp4a
    from tests.helpers.gguf_writer import write_tiny_q4_k_m_like_llama

    path = write_tiny_q4_k_m_like_llama(tmp_path / "q4_k_m.gguf")
    monkeypatch.setattr(engine_module, "compute_dtype", lambda device, config: torch.bfloat16)
    pair_calls = []
    pair_matmul = gemv_dp4a.matmul_pair
    monkeypatch.setattr(gemv_dp4a, "matmul_pair",
                        lambda *args, **kwargs: pair_calls.append(1) or pair_matmul(*args,
                                                                                     **kwargs))
    engine = _engine(path, monkeypatch, quantized=True)
    try:
        first, second = (layer.self_attn for layer in engine.model.model.layers)
        assert first.qkv_weight is None and first.qkv_pair is not None
        assert first.qkv_pair.qtypes == (12, 14)  # Q4_K, Q6_K
        assert second.qkv_weight is not None and second.qkv_pair is None
        spec = SamplingSpec(max_tokens=NUM_NEW, temperature=0.0)
        tokens = []
        for pairs in (True, False):
            if not pairs:
                first.qkv_pair = None
            decoder = GraphDecoder(engine.model, use_cuda_graphs=False,
                                   compile_pointwise=False, min_bucket_tokens=16,
                                   prefill_chunk_tokens=20)
            kv = KVCache.for_config(engine.model.config, 64, torch.bfloat16)
            before = len(pair_calls)
            tokens.append(list(decoder.generate(kv, PROMPT, spec, max_new_tokens=NUM_NEW)))
            assert (len(pair_calls) - before >= NUM_NEW - 1) == pairs
        assert tokens[0] == tokens[1]
    finally:
        engine.close()


def test_experts_of_mixed_float_and_block_types_fall_back_with_one_log_line(
        tmp_path, monkeypatch, caplog) -> None:
    """One store holds blocks or floats: an F16 expert tensor among Q8_0 ones dequantizes
    the experts (tests/core/test_quant_experts.py covers experts kept as blocks)."""
    path = _gguf(tmp_path, "qwen3_moe", "Q8_0", {"blk.1.ffn_down_exps.weight": "F16"})
    expected, _ = _dequantized_run(path, monkeypatch)
    with caplog.at_level(logging.INFO, logger="strata.engine.core.residency"):
        engine = _engine(path, monkeypatch, quantized=True)
    try:
        lines = [r.getMessage() for r in caplog.records if "experts of" in r.getMessage()]
        assert lines == [("experts of 2 layers (Q8_0, float) are dequantized to float32: one "
                          "expert store holds blocks only when every expert tensor has a "
                          "quantized kernel")]
        layer = engine.model.model.layers[0]
        assert isinstance(layer.self_attn.o_proj, QuantizedLinear)
        assert layer.mlp.experts.gate_proj.dtype == torch.float32
        assert _greedy(engine) == expected
    finally:
        engine.close()


def test_dp4a_decodes_q4_k_m_like_blocks_like_the_planes_kernel(tmp_path, monkeypatch) -> None:
    """bf16 compute (as on a GPU): one token times Q4_K, Q6_K (v, a down, the head) and
    Q8_0 (the other down) blocks takes the dp4a GEMVs, whose greedy tokens equal the planes
    kernel's (STRATA_DP4A=0). Random K-quant blocks of small scales (the writer cannot
    quantize K-quants) keep the activations moderate, so attention is not a coin flip."""
    from strata.engine.core import engine as engine_module
    from strata.engine.core.quant import gemv_dp4a
    from tests.helpers.gguf_writer import write_tiny_q4_k_m_like_llama

    path = write_tiny_q4_k_m_like_llama(tmp_path / "q4_k_m.gguf")
    monkeypatch.setattr(engine_module, "compute_dtype", lambda device, config: torch.bfloat16)
    calls: dict[int, int] = {}
    dp4a = gemv_dp4a.matmul

    def counted(x, raw, qtype, *args, **kwargs):
        calls[int(qtype)] = calls.get(int(qtype), 0) + 1
        return dp4a(x, raw, qtype, *args, **kwargs)

    monkeypatch.setattr(gemv_dp4a, "matmul", counted)
    assert_dp4a_matches_planes(monkeypatch, lambda: _engine(path, monkeypatch, quantized=True),
                               PROMPT, 2)  # the prefill's head, one step
    assert set(calls) == {12, 14, 8}  # every dp4a type ran


def test_quantized_glm4_moe_keeps_its_shared_expert_and_experts_as_blocks(tmp_path,
                                                                          monkeypatch) -> None:
    """GLM-4.5's shared expert is a linear layer like any dense MLP: it stays in its blocks,
    beside the routed experts, and the model decodes as with everything dequantized."""
    from strata.engine.core.quant.experts import is_quantized_experts

    path = _gguf(tmp_path, "glm4_moe", "Q8_0")
    expected, float_bytes = _dequantized_run(path, monkeypatch)
    engine = _engine(path, monkeypatch, quantized=True)
    try:
        moe = engine.model.model.layers[1].mlp
        assert isinstance(moe.shared_experts.up_proj, QuantizedLinear)
        assert is_quantized_experts(moe.experts.up_proj)
        assert not isinstance(moe.router, QuantizedLinear)  # routers stay float
        assert engine.memory.weights.allocated_bytes < float_bytes / 2
        assert _greedy(engine) == expected
    finally:
        engine.close()


@pytest.mark.parametrize("intermediate", [64, 32])
def test_gpt_oss_mxfp4_experts_stay_blocks_and_decode_like_dequantized(
        tmp_path, monkeypatch, caplog, intermediate) -> None:
    """MXFP4 experts read by the tile kernels (the reference MoE dequantizes the routed
    experts one at a time); down rows of 32 values are one 17-byte block, an odd row the
    kernels cannot read: then the experts are dequantized at load, with one log line."""
    import transformers

    from strata.engine.core.quant.experts import QuantizedExperts

    config = make_tiny_hf_config("gpt_oss")
    config.intermediate_size = intermediate
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    mix = {f"blk.{i}.ffn_{p}_exps.weight": "MXFP4"
           for i in range(config.num_hidden_layers) for p in ("gate", "up", "down")}
    path = write_gguf_from_hf(model, None, tmp_path / "gpt-oss.gguf", "Q8_0",
                              qtype_overrides=mix)
    expected, _ = _dequantized_run(path, monkeypatch)
    with caplog.at_level(logging.INFO, logger="strata.engine.core.residency"):
        engine = _engine(path, monkeypatch, quantized=True)
    try:
        experts = engine.model.model.layers[0].mlp.experts
        lines = [r.getMessage() for r in caplog.records if "experts of" in r.getMessage()]
        if intermediate == 64:
            assert isinstance(experts.down_proj, QuantizedExperts) and not lines
            assert experts.down_proj.qtype.name == "MXFP4"
        else:
            assert experts.down_proj.dtype == torch.float32 and len(lines) == 1
        assert isinstance(engine.model.model.layers[0].self_attn.q_proj, QuantizedLinear)
        assert _greedy(engine) == expected
    finally:
        engine.close()


def test_gpt_oss_openai_mxfp4_safetensors_stay_blocks(tmp_path, monkeypatch) -> None:
    """The original release's MXFP4 experts (an HF directory) become GGML MXFP4 blocks in the
    expert store, decoding like the same directory dequantized at load."""
    import transformers

    from strata.engine.core.quant.experts import QuantizedExperts
    from tests.helpers.quant_blocks import save_experts_as_openai_mxfp4

    config = make_tiny_hf_config("gpt_oss")
    config.intermediate_size = 64  # down rows of two 17-byte blocks: even, read as blocks
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    directory = tmp_path / "gpt-oss"
    model.save_pretrained(directory)
    save_experts_as_openai_mxfp4(directory, model)
    expected, _ = _dequantized_run(directory, monkeypatch)
    engine = _engine(directory, monkeypatch, quantized=True)
    try:
        experts = engine.model.model.layers[1].mlp.experts
        assert isinstance(experts.gate_proj, QuantizedExperts)
        assert experts.gate_proj.qtype.name == "MXFP4"
        assert _greedy(engine) == expected
    finally:
        engine.close()
