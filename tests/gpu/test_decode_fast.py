"""The fast decode paths on CUDA: graphs replay what the eager step computes, bf16 tracks the
reference forward, MoE grouped kernels agree, and a 32k prompt prefills without [T, S] scores.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from strata.engine.core.fast import GraphDecoder
from strata.engine.core.fast.prefill import prefill
from strata.engine.core.kv_cache import KVCache
from strata.engine.core.model_config import ModelConfig
from strata.engine.core.random_weights import build_random_model
from strata.engine.protocol import SamplingSpec
from tests.helpers.fast_configs import SMALL_CONFIGS

pytestmark = pytest.mark.gpu

CONFIGS = SMALL_CONFIGS
GREEDY = SamplingSpec(max_tokens=64, temperature=0.0)
PROMPT = [(11 * i + 5) % 512 for i in range(40)]


def model_for(name: str, dtype=torch.bfloat16):
    return build_random_model(CONFIGS[name], "cuda", dtype, seed=0, std=0.1)


def agreement(ref_logits: torch.Tensor, tokens: list[int], tie_std: float = 0.05) -> float:
    """Share of positions whose fast-path token the reference would pick too: its argmax, or
    a bf16 near-tie with it (within tie_std standard deviations of that position's logits).

    ref_logits [N, V] teacher-forced over the fast path's own tokens."""
    chosen = ref_logits.gather(-1, torch.tensor(tokens, device=ref_logits.device)[:, None])[:, 0]
    gap = ref_logits.max(-1).values - chosen
    return (gap <= tie_std * ref_logits.float().std(-1)).float().mean().item()


def run(decoder: GraphDecoder, spec: SamplingSpec, num_new: int = 60) -> list[int]:
    kv = KVCache.for_config(decoder.model.config, 256, torch.bfloat16, "cuda")
    return list(decoder.generate(kv, PROMPT, spec, num_new))


@pytest.mark.parametrize("name,moe_impl", [("llama", "auto"), ("qwen3_moe", "triton"),
                                           ("qwen3_moe", "bmm")])
@pytest.mark.parametrize("compiled", [False, True])
def test_graph_replay_equals_eager_step(name, moe_impl, compiled) -> None:
    """Same kernels with and without a graph: identical tokens, across buckets 64 -> 128."""
    model = model_for(name)
    kwargs = {"moe_impl": moe_impl, "compile_pointwise": compiled, "min_bucket_tokens": 64}
    graphed = GraphDecoder(model, use_cuda_graphs=True, **kwargs)
    eager = GraphDecoder(model, use_cuda_graphs=False, **kwargs)
    assert graphed.use_cuda_graphs and graphed.moe_impl == (moe_impl if name != "llama" else "loop")
    for spec in (GREEDY, SamplingSpec(temperature=0.8, top_p=0.9, top_k=50, seed=11)):
        assert run(graphed, spec) == run(eager, spec)
    # Positions 40..99: buckets 64 and 128, for each of the two sampling keys.
    assert {(key[1], key[2][0]) for key in graphed.runner.graphs} == {
        (64, "greedy"), (128, "greedy"), (64, "sample"), (128, "sample")}


def test_spread_capture_runs_real_steps_before_it_captures() -> None:
    """After a live shrink the runner spreads a new graph's warm-up over real steps (no step
    pays a whole capture): the first WARMUP_STEPS steps of a bucket run eagerly, the next
    captures; the tokens equal an eager decoder's."""
    from strata.engine.core.fast.decode_runner import WARMUP_STEPS

    model = model_for("qwen3_moe")
    kwargs = {"moe_impl": "triton", "min_bucket_tokens": 64}
    spread = GraphDecoder(model, use_cuda_graphs=True, **kwargs)
    runner = spread.runner
    runner.spread_capture = True
    runner.prepare = lambda *args, **kwargs: None  # captured lazily, as after the switch
    eager = GraphDecoder(model, use_cuda_graphs=False, **kwargs)
    assert run(spread, GREEDY) == run(eager, GREEDY)
    assert {(key[1], key[2][0]) for key in runner.graphs} == {(64, "greedy"), (128, "greedy")}
    assert sorted(runner._eager_runs.values()) == [WARMUP_STEPS, WARMUP_STEPS]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fast_path_tracks_the_reference_forward(name) -> None:
    """bf16 fast decode (graphs, compiled ops, grouped MoE) vs the reference model forward."""
    model = model_for(name)
    kv_ref = KVCache.for_config(model.config, 256, torch.bfloat16, "cuda")
    decoder = GraphDecoder(model, min_bucket_tokens=64)
    tokens = run(decoder, GREEDY, num_new=24)
    # Teacher-force the fast path's tokens through the reference and compare next-token picks.
    with torch.inference_mode():
        logits = model(torch.tensor(PROMPT + tokens[:-1], device="cuda"), 0, kv_ref)
    ref_picks = logits[len(PROMPT) - 1 :].argmax(-1).tolist()
    assert agreement(logits[len(PROMPT) - 1 :], tokens) >= 0.85, (ref_picks, tokens)


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("compiled", [False, True])
def test_prefill_chunks_match_reference_on_cuda(name, compiled) -> None:
    """Chunks of 64 and a last one of 8 (dynamic shapes when compiled): logits and K/V."""
    from strata.engine.core.fast.compiled import compiled_ops
    from strata.engine.core.fast.pointwise import EAGER_OPS

    model = model_for(name)
    ops = compiled_ops(dynamic=True) if compiled else EAGER_OPS
    ids = torch.tensor(PROMPT * 5, device="cuda")  # 200 tokens
    kv_ref = KVCache.for_config(model.config, 256, torch.bfloat16, "cuda")
    kv = KVCache.for_config(model.config, 256, torch.bfloat16, "cuda")
    with torch.inference_mode():
        ref = model(ids, 0, kv_ref)[-1]
        got = prefill(model, kv, ids, 0, chunk_tokens=64, moe_impl="triton", ops=ops)
        again = prefill(model, kv, ids[:150], 0, chunk_tokens=64, moe_impl="triton", ops=ops)
    cosine = torch.nn.functional.cosine_similarity(ref, got, dim=0)
    assert cosine > 0.99, cosine
    for k_ref, k_got in zip(kv_ref.k, kv.k, strict=True):
        rows = torch.nn.functional.cosine_similarity(k_ref[:150].float().flatten(1),
                                                     k_got[:150].float().flatten(1), dim=-1)
        # A bf16 near-tie in routing may send one token to another expert (0.93 seen): a
        # wrong kernel would move every row, not one.
        assert rows.mean() > 0.995 and rows.min() > 0.8, (rows.mean(), rows.min())
    assert torch.isfinite(again).all()


def test_32k_prompt_prefills_without_quadratic_memory() -> None:
    model = model_for("llama")
    num_tokens = 32768
    kv = KVCache.for_config(model.config, num_tokens, torch.bfloat16, "cuda")
    ids = torch.randint(0, 512, (num_tokens,), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with torch.inference_mode():
        logits = prefill(model, kv, ids, 0, chunk_tokens=2048)
    peak_mib = (torch.cuda.max_memory_allocated() - base) / (1 << 20)
    assert torch.isfinite(logits).all()
    # [8 heads, 2048, 32768] bf16 scores alone would be 1 GiB; flash needs a few MiB per chunk.
    assert peak_mib < 256, f"chunked prefill peaked at {peak_mib:.0f} MiB above the KV cache"


def test_moe_prefill_groups_rows_on_cuda() -> None:
    """Sorted rows through torch._grouped_mm (bf16) agree with the per-expert reference loop."""
    from strata.engine.core.fast import moe_prefill
    from strata.engine.core.fast.moe_grouped import route

    model = model_for("qwen3_moe")
    moe = model.model.layers[0].mlp
    x = torch.randn(300, 256, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        weights, ids = route(moe, x)
        got = moe_prefill.experts_sorted(moe, x, weights, ids)
        ref = moe(x)
    assert moe_prefill._grouped_mm_works, "torch._grouped_mm did not run: the loop fallback did"
    cosine = torch.nn.functional.cosine_similarity(got.float(), ref.float(), dim=-1)
    assert cosine.min() > 0.99, cosine.min()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_prefill_attention_is_fused_and_exact_on_cuda(dtype) -> None:
    """GQA lower-right attention on flash (bf16) or efficient (fp32) matches repeated heads."""
    from strata.engine.core.kernels.prefill_attention import flash_attention

    q = torch.randn(8, 64, 32, device="cuda", dtype=dtype)
    keys = torch.randn(2, 200, 32, device="cuda", dtype=dtype)
    values = torch.randn(2, 200, 32, device="cuda", dtype=dtype)
    got = flash_attention(q, keys, values).float()
    k, v = keys.float().repeat_interleave(4, 0), values.float().repeat_interleave(4, 0)
    mask = torch.arange(200, device="cuda")[None, :] <= torch.arange(136, 200, device="cuda")[:, None]
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k, v, attn_mask=mask)
    torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)


def test_first_chunk_attention_on_cudnn_matches_on_cuda() -> None:
    """A full chunk at position 0 (T == S, causal) takes cuDNN where it runs; same result."""
    from strata.engine.core.kernels import prefill_attention

    q = torch.randn(32, 300, 128, device="cuda", dtype=torch.bfloat16)
    # Keys as the engine passes them: a transposed view of the [S, Hkv, D] cache.
    keys = torch.randn(300, 8, 128, device="cuda", dtype=torch.bfloat16).transpose(0, 1)
    values = torch.randn(300, 8, 128, device="cuda", dtype=torch.bfloat16).transpose(0, 1)
    got = prefill_attention.flash_attention(q, keys, values, prefer_cudnn=True).float()
    k, v = keys.float().repeat_interleave(4, 0), values.float().repeat_interleave(4, 0)
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k, v, is_causal=True)
    torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)
    if torch.cuda.get_device_capability() >= (9, 0):
        assert prefill_attention._cudnn_works, "cuDNN attention did not run on a Hopper GPU"


@pytest.mark.parametrize("model_type,heads,kv_heads,head_dim", [
    ("llama", 32, 8, 128), ("qwen3", 32, 4, 128), ("llama", 9, 3, 64)])
@pytest.mark.parametrize("num_keys", [1, 300, 5000])
def test_fused_decode_attention_compiles_and_matches_on_cuda(model_type, heads, kv_heads,
                                                             head_dim, num_keys) -> None:
    """The Triton decode attention (norm+RoPE, K/V write, split softmax) vs torch, in bf16."""
    from strata.engine.core.fast.decode_attention import check_fused

    config = ModelConfig(model_type=model_type, vocab_size=64, hidden_size=256,
                         intermediate_size=64, num_hidden_layers=1, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, head_dim=head_dim,
                         max_position_embeddings=8192)
    attn = build_random_model(config, "cuda", torch.bfloat16, seed=0).model.layers[0].self_attn
    assert check_fused(attn, torch.bfloat16, torch.device("cuda"), num_keys) == ""


def test_decoders_on_cuda_use_the_fused_attention() -> None:
    hopper = torch.cuda.get_device_capability()[0] >= 9
    for name in CONFIGS:
        decoder = GraphDecoder(model_for(name))
        assert decoder.ops.fused_attention and decoder.ops.dense_kernels, decoder.note
        assert decoder.ops.pdl == hopper


@pytest.mark.parametrize("name", list(CONFIGS))
def test_pdl_chain_computes_what_serial_launches_compute(name) -> None:
    """The Triton decode step with PDL launches, graphed, against the same kernels launched
    one after another without a graph: a kernel reading before its wait would differ."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs compute capability 9.0")
    model = model_for(name)
    chained = GraphDecoder(model, min_bucket_tokens=64)
    assert chained.use_cuda_graphs and chained.ops.pdl, chained.note
    serial = GraphDecoder(model, use_cuda_graphs=False, min_bucket_tokens=64)
    serial.ops = dataclasses.replace(serial.ops, pdl=False)
    for spec in (GREEDY, SamplingSpec(temperature=0.8, top_p=0.9, top_k=50, seed=11)):
        assert run(chained, spec) == run(serial, spec)


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_fused_views_on_vmm_arena_match_separate_projections(model_type) -> None:
    """One GEMM over the arena's [q;k;v] / [gate;up] views (bf16, graphs, compiled ops, fused
    attention) vs the same model with the views detached, and vs the reference forward."""
    from strata.engine.core.fast.compiled import compiled_ops
    from strata.engine.core.fast.pointwise import EAGER_OPS
    from strata.engine.core.fused_views import detach_fused_views, fused_gate_up, fused_qkv
    from strata.engine.core.memory.backend import backend_for
    from strata.engine.core.residency import ModelMemory
    from strata.engine.core.weight_source import RandomWeights

    # head_dim 64: a bf16 k/v bias of 2 heads is 256 bytes, so Qwen2's biases lie adjacent too.
    config = dataclasses.replace(CONFIGS["llama"], model_type=model_type,
                                 attention_bias=model_type == "qwen2", head_dim=64)
    backend = backend_for("cuda")
    memory = ModelMemory(backend, torch.bfloat16)
    try:
        model = memory.build(config, RandomWeights(backend.device, std=0.1), "all")
        layers = model.model.layers
        assert all(fused_qkv(layer.self_attn) is not None and fused_gate_up(layer.mlp) is not None
                   for layer in layers)
        ids = torch.tensor(PROMPT * 3, device="cuda")  # 120 tokens: strided views in prefill

        def prefill_logits(ops=EAGER_OPS):
            kv = KVCache.for_config(config, 256, torch.bfloat16, "cuda")
            with torch.inference_mode():
                return prefill(model, kv, ids, 0, chunk_tokens=64, ops=ops)

        fused_logits = prefill_logits()
        # The compiled (dynamic-shape) element-wise groups over the row-strided fused outputs.
        compiled = prefill_logits(compiled_ops(dynamic=True))
        assert torch.nn.functional.cosine_similarity(fused_logits, compiled, dim=0) > 0.999
        tokens = run(GraphDecoder(model, min_bucket_tokens=64), GREEDY, num_new=24)
        detach_fused_views(model)
        cosine = torch.nn.functional.cosine_similarity(fused_logits, prefill_logits(), dim=0)
        assert cosine > 0.999, cosine
        kv_ref = KVCache.for_config(config, 256, torch.bfloat16, "cuda")
        with torch.inference_mode():
            logits = model(torch.tensor(PROMPT + tokens[:-1], device="cuda"), 0, kv_ref)
        ref_picks = logits[len(PROMPT) - 1 :].argmax(-1).tolist()
        assert agreement(logits[len(PROMPT) - 1 :], tokens) >= 0.85, (ref_picks, tokens)
    finally:
        memory.close()


def test_router_topk_matches_torch_on_cuda() -> None:
    """Qwen3-30B-A3B's router shape in bf16: the one-launch router picks torch's experts (up
    to bf16 near-ties) with its weights, over many tokens, and leaves its counter at 0."""
    from strata.engine.core.fast.moe_triton import _counter, router_topk

    gen = torch.Generator(device="cuda").manual_seed(0)
    router = torch.randn(128, 2048, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    for _ in range(50):
        x = torch.randn(2048, device="cuda", dtype=torch.bfloat16, generator=gen)
        probs = torch.softmax(torch.nn.functional.linear(x, router).float(), dim=-1)
        ref_p = torch.topk(probs, 8).values
        weights, ids = router_topk(x, router, 8, True)
        # The picked experts' reference probabilities are the top 8 (ties may swap ids).
        torch.testing.assert_close(probs[ids], ref_p, rtol=1e-2, atol=1e-4)
        torch.testing.assert_close(weights.float(), ref_p / ref_p.sum(), rtol=2e-2, atol=1e-3)
    assert _counter(x.device).item() == 0


@pytest.mark.parametrize("name", list(CONFIGS))
def test_load_warm_up_then_full_chunks_on_cuda(name) -> None:
    """The load-time warm-up (compiled groups, cuDNN's full-chunk plan) runs on CUDA; then a
    prompt of full chunks (cuDNN) and a short one (flash) match the reference forward."""
    from strata.engine.core.kernels import prefill_attention

    model = model_for(name)
    decoder = GraphDecoder(model, prefill_chunk_tokens=64)
    assert decoder.warm_up_prefill() > 0
    for num_tokens in (128, 45):
        ids = torch.tensor((PROMPT * 4)[:num_tokens], device="cuda")
        kv_ref = KVCache.for_config(model.config, 256, torch.bfloat16, "cuda")
        kv = KVCache.for_config(model.config, 256, torch.bfloat16, "cuda")
        with torch.inference_mode():
            ref = model(ids, 0, kv_ref)[-1]
        got = decoder.prefill(kv, ids, 0)
        assert torch.nn.functional.cosine_similarity(ref, got, dim=0) > 0.99
    if torch.cuda.get_device_capability() >= (9, 0):
        assert prefill_attention._cudnn_works
