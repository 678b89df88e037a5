"""Fresh prompts padded to a bucket (fast/prefill_graph.py): the padded prefill a graph
replays gives the unpadded prompt's logits and K/V; the bucket rules. The graphs themselves
need CUDA: tests/gpu/test_prefill_graph_cuda.py."""

from __future__ import annotations

import os

import pytest
import torch

# Must precede the first Triton import (as in test_fast_paths.py): triton.jit picks the
# interpreter at decoration time.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from strata.engine.core.fast import GraphDecoder, prefill
from strata.engine.core.fast.prefill_graph import (
    MIN_BUCKET_TOKENS,
    PrefillGraphs,
    bucket_sizes,
    graph_tokens,
    prompt_bucket,
)
from strata.engine.core.kv_cache import KVCache
from strata.engine.core.random_weights import build_random_model
from tests.helpers.fast_configs import TINY_CONFIGS

CONFIGS = {name: TINY_CONFIGS[name] for name in ("llama", "qwen3_moe", "glm4_moe")}


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("num_tokens", [1, 11, 32])
def test_padded_prefill_answers_for_the_prompt_alone(name: str, num_tokens: int) -> None:
    model = build_random_model(CONFIGS[name], "cpu", torch.float32, seed=3, std=0.15)
    prompt = torch.tensor([(7 * i + 2) % 96 for i in range(num_tokens)])
    kv_ref = KVCache.for_config(model.config, 64)
    ref = prefill(model, kv_ref, prompt, 0, moe_impl="bmm")
    padded = torch.cat([prompt, torch.full((32 - num_tokens,), 5)]) if num_tokens < 32 else prompt
    kv = KVCache.for_config(model.config, 64)
    got = prefill(model, kv, padded, 0, moe_impl="bmm", last_index=torch.tensor([num_tokens - 1]))
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    for layer in range(model.config.num_hidden_layers):
        torch.testing.assert_close(kv.k[layer][:num_tokens], kv_ref.k[layer][:num_tokens],
                                   rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(kv.v[layer][:num_tokens], kv_ref.v[layer][:num_tokens],
                                   rtol=1e-5, atol=1e-5)


def test_padded_prefill_must_fit_one_chunk() -> None:
    model = build_random_model(CONFIGS["llama"], "cpu", torch.float32, seed=0)
    kv = KVCache.for_config(model.config, 64)
    with pytest.raises(ValueError, match="must fit one chunk of 16 tokens"):
        prefill(model, kv, torch.arange(32), 0, chunk_tokens=16, last_index=torch.tensor([3]))


def test_buckets_are_powers_of_two_up_to_the_limit() -> None:
    assert bucket_sizes(4096) == [16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
    assert bucket_sizes(3000) == [16, 32, 64, 128, 256, 512, 1024, 2048, 3000]
    assert bucket_sizes(MIN_BUCKET_TOKENS) == [MIN_BUCKET_TOKENS]
    assert [prompt_bucket(n, 3000) for n in (1, 16, 17, 1000, 2049, 3000)] == \
        [16, 16, 32, 1024, 3000, 3000]


def test_graphs_stop_where_a_replay_would_outlast_the_host() -> None:
    # H200 figures (bench/diag_prefill_ops.py --replay): a 4096-token chunk replayed, a called
    # prefill's host time.
    assert graph_tokens(host_s=0.025, chunk_replay_s=0.0064, chunk_tokens=4096) == 4096  # SmolLM2
    assert graph_tokens(host_s=0.040, chunk_replay_s=0.106, chunk_tokens=4096) == 1024  # Llama-3-8B
    assert graph_tokens(host_s=0.059, chunk_replay_s=0.067, chunk_tokens=4096) == 2048  # Qwen3
    assert graph_tokens(host_s=0.001, chunk_replay_s=1.0, chunk_tokens=4096) == 0


def test_a_prompt_takes_a_graph_only_where_its_bucket_fits() -> None:
    graphs = PrefillGraphs(lambda kv, ids, last: None, torch.device("cpu"), max_tokens=1024)
    small_kv = KVCache.for_config(CONFIGS["llama"], 100)
    big_kv = KVCache.for_config(CONFIGS["llama"], 2048)
    assert graphs.bucket(60, big_kv) == 64
    assert graphs.bucket(60, small_kv) == 64
    assert graphs.bucket(90, small_kv) is None  # 128 positions would not fit
    assert graphs.bucket(1025, big_kv) is None  # longer than graphs pay for
    assert graphs.bucket(0, big_kv) is None
    with pytest.raises(ValueError, match="no prefill graph takes 1025 tokens"):
        graphs.run(big_kv, torch.arange(1025))


def test_without_cuda_graphs_prefill_is_called_and_reaches_the_prompt() -> None:
    model = build_random_model(CONFIGS["llama"], "cpu", torch.float32, seed=0)
    decoder = GraphDecoder(model)
    assert decoder.plan_prefill_graphs() == {}
    assert decoder.prefill_graphs is None
    kv = KVCache.for_config(model.config, 64)
    assert decoder.prefill_reach(kv, 11, 0) == 11
    assert decoder.prefill_reach(kv, 11, 20) == 31
    assert decoder.tune_prefill()["graphs"] == {}
