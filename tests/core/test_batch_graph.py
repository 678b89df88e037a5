"""The batched decode step of fast/batch_graph.py on the CPU, float32: bucket choice, padding
rows that write nothing, the step's logits and K/V equal to the eager batched forward, the
batched attention kernels (Triton's CPU interpreter) equal to their torch twin, and an engine
whose batches run through the step giving each sequence its tokens alone. The GPU test
(tests/gpu/test_batch_graph_cuda.py) replays the same step from CUDA graphs in bf16."""

from __future__ import annotations

import os

import pytest
import torch

# Must precede the first Triton import (see test_fast_paths.py).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="Triton CPU interpreter not enabled")

from strata.engine.core.fast.batch_attention import PAD_POSITION, check_batch_attention
from strata.engine.core.fast.batch_graph import BatchDecoder, batch_bucket
from strata.engine.core.fast.pointwise import EAGER_OPS
from strata.engine.core.kv_cache import KVCache
from strata.engine.core.random_weights import build_random_model
from tests.helpers.fast_configs import TINY_CONFIGS
from tests.helpers.tiny_models import make_tiny_hf_model

MAX_TOKENS = 300


def tiny_model(name: str):
    model = build_random_model(TINY_CONFIGS[name], "cpu", torch.float32, seed=1, std=0.15)
    if name == "gemma3":  # random (1 + w) norms: a norm applied as w would show
        gen = torch.Generator().manual_seed(5)
        for param_name, param in model.named_parameters():
            if param_name.endswith("norm.weight"):
                param.data.copy_(torch.randn(param.shape, generator=gen) * 0.5)
    return model


def test_batch_buckets() -> None:
    assert [batch_bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 16)] == [1, 2, 4, 4, 8, 8, 16, 16]
    for bad in (0, 17):
        with pytest.raises(ValueError):
            batch_bucket(bad)


def filled_caches(model, lengths: list[int]) -> list[KVCache]:
    """One cache per sequence, prefilled with a prompt of that length."""
    caches = []
    for i, length in enumerate(lengths):
        kv = KVCache.for_config(model.config, MAX_TOKENS)
        prompt = torch.tensor([(11 * i + 5 * j) % 90 + 3 for j in range(length)])
        with torch.inference_mode():
            model(prompt, 0, kv)
        caches.append(kv)
    return caches


def clones(caches: list[KVCache]) -> list[KVCache]:
    out = []
    for kv in caches:
        copy = KVCache(kv.num_layers, kv.num_kv_heads, kv.head_dim, kv.max_tokens, kv.dtype)
        for dst, src in zip((*copy.k, *copy.v), (*kv.k, *kv.v)):
            dst.copy_(src)
        out.append(copy)
    return out


@pytest.mark.parametrize("name", ["llama", "qwen3", "qwen3_moe", "mixtral", "gemma3", "glm4_moe",
                                  "gpt_oss"])
def test_a_padded_step_equals_the_eager_batched_forward(name: str) -> None:
    model = tiny_model(name)
    lengths = [5, 40, 17]  # three rows: padded to the bucket of 4
    caches = filled_caches(model, lengths)
    expected_caches = clones(caches)
    tokens = [7, 19, 33]
    decoder = BatchDecoder(model, EAGER_OPS, "bmm", use_cuda_graphs=False,
                           fused_attention=False, min_bucket_tokens=16)
    got = decoder.forward(tokens, lengths, caches).clone()
    with torch.inference_mode():
        expected = model.forward_decode_batch(torch.tensor(tokens), lengths, expected_caches)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert got.shape == (3, model.config.vocab_size)
    assert decoder._buffers[4].host_positions[3] == PAD_POSITION
    for kv, ref, length in zip(caches, expected_caches, lengths):
        for mine, theirs in zip((*kv.k, *kv.v), (*ref.k, *ref.v)):
            # The new row written, nothing after it touched.
            torch.testing.assert_close(mine[: length + 1], theirs[: length + 1], rtol=1e-4,
                                       atol=1e-4)
            assert not mine[length + 1 :].any()


def test_a_batch_of_one_and_of_sixteen() -> None:
    model = tiny_model("llama")
    decoder = BatchDecoder(model, EAGER_OPS, "bmm", use_cuda_graphs=False,
                           fused_attention=False, min_bucket_tokens=16)
    lengths = [3 + 2 * i for i in range(16)]
    caches = filled_caches(model, lengths)
    expected_caches = clones(caches)
    tokens = list(range(20, 36))
    got = decoder.forward(tokens, lengths, caches).clone()
    with torch.inference_mode():
        expected = model.forward_decode_batch(torch.tensor(tokens), lengths, expected_caches)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    one = decoder.forward([5], [lengths[0] + 1], caches[:1])
    assert one.shape == (1, model.config.vocab_size)
    with pytest.raises(ValueError, match=r"1\.\.16"):
        decoder.forward([*tokens, 1], [*lengths, 1], caches + caches[:1])
    with pytest.raises(ValueError, match="does not fit"):
        decoder.forward([1], [MAX_TOKENS], caches[:1])


def test_graphs_need_the_fused_attention() -> None:
    with pytest.raises(ValueError, match="batched attention kernels"):
        BatchDecoder(tiny_model("llama"), EAGER_OPS, "bmm", use_cuda_graphs=True,
                     fused_attention=False)


@needs_interpreter
@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_the_batched_attention_kernels_match_their_torch_twin(name: str) -> None:
    """Rows in caches of their own (found by offset from one base) and a padding row."""
    attn = tiny_model(name).model.layers[0].self_attn
    assert check_batch_attention(attn, torch.float32, torch.device("cpu"), num_keys=80) == ""


@needs_interpreter
@pytest.mark.parametrize("name", ["qwen3", "gemma3"])
def test_the_fused_step_equals_the_torch_step(name: str) -> None:
    """The step with the batched kernels (what a graph captures) against the torch one;
    Gemma 3's rows past its window of 5."""
    model = tiny_model(name)
    lengths = [4, 30]
    caches = filled_caches(model, lengths)
    expected_caches = clones(caches)
    fused = BatchDecoder(model, EAGER_OPS, "bmm", use_cuda_graphs=False, fused_attention=True,
                         min_bucket_tokens=16)
    eager = BatchDecoder(model, EAGER_OPS, "bmm", use_cuda_graphs=False, fused_attention=False,
                         min_bucket_tokens=16)
    got = fused.forward([9, 10], lengths, caches).clone()
    expected = eager.forward([9, 10], lengths, expected_caches)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    for kv, ref in zip(caches, expected_caches):
        for mine, theirs in zip((*kv.k, *kv.v), (*ref.k, *ref.v)):
            torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)


def test_a_divergence_is_excused_only_by_a_tie_in_logits_or_routing(tmp_path) -> None:
    """batch_helpers' oracle: a far-apart pick after confident routing fails (and says so);
    a model without experts has no routing margin."""
    from strata.engine.core.engine import Engine, EngineConfig
    from tests.core.batch_helpers import (
        NEAR_TIE_ROUTING,
        assert_same_or_near_tie,
        reference_logits,
        routing_margin,
    )

    for variant in ("llama", "qwen3_moe"):
        path, _ = make_tiny_hf_model(variant, tmp_path / variant)
        engine = Engine(EngineConfig(model_path=str(path), device="cpu"))
        engine.load()
        try:
            prompts = [[(5 * s + 3 * j) % 300 + 5 for j in range(12)] for s in range(20)]
            margins = [routing_margin(engine, p, len(p) - 1) for p in prompts]
            if variant == "llama":
                assert margins == [None] * len(prompts)
                prompt = prompts[0]
            else:
                assert all(0.0 <= m <= 1.0 for m in margins)
                prompt = next(p for p, m in zip(prompts, margins) if m >= NEAR_TIE_ROUTING)
            logits = reference_logits(engine, prompt)
            best, worst = int(logits.argmax()), int(logits.argmin())
            assert_same_or_near_tie(engine, prompt, [best], [best])
            with pytest.raises(AssertionError, match="smallest router margin"):
                assert_same_or_near_tie(engine, prompt, [best], [worst])
        finally:
            engine.close()


@pytest.mark.parametrize("variant", ["llama", "qwen3_moe"])
def test_an_engine_batching_through_the_step_equals_each_sequence_alone(tmp_path,
                                                                        variant) -> None:
    """The runner's path for batches on the GPU, eagerly on the CPU: 18 sequences (groups of
    16 and 2), greedy and seeded-sampled ones side by side, one cancelled mid-run."""
    from strata.engine.core.engine import Engine, EngineConfig
    from strata.engine.protocol import SamplingSpec
    from tests.core.batch_helpers import alone, run_batch

    path, _ = make_tiny_hf_model(variant, tmp_path)
    engine = Engine(EngineConfig(model_path=str(path), device="cpu", num_slots=18,
                                 prefill_chunk_tokens=64))
    engine.load()
    try:
        step = BatchDecoder(engine.model, EAGER_OPS, "bmm", use_cuda_graphs=False,
                            fused_attention=False, min_bucket_tokens=16)
        engine._runner.batch = step
        chats = [[(13 * i + 7 * j) % 300 + 5 for j in range(3 + i)] for i in range(18)]
        specs = [SamplingSpec(max_tokens=6) if i % 3 else
                 SamplingSpec(max_tokens=6, temperature=0.9, seed=i, repeat_penalty=1.2)
                 for i in range(18)]
        expected = [alone(engine, p, s, i) for i, (p, s) in enumerate(zip(chats, specs))]
        got = run_batch(engine, {f"r{i}": (p, s, i) for i, (p, s) in
                                 enumerate(zip(chats, specs))})
        assert [got.tokens[f"r{i}"] for i in range(18)] == expected
        assert 16 in step._buffers and 2 in step._buffers  # 18 rows: groups of 16 and 2
        engine.add("a", chats[0], SamplingSpec(max_tokens=8), 0)
        engine.add("b", chats[1], SamplingSpec(max_tokens=8), 1)
        engine.step(), engine.step()
        assert engine.cancel("a").usage.finish_reason == "cancelled"
        rest = run_batch(engine, {})
        # Step 1 prefilled both and drew their first tokens, step 2 decoded one more each.
        assert len(rest.tokens["b"]) == 6 and rest.usage["b"].finish_reason == "length"
    finally:
        engine.close()
