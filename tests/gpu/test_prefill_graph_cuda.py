"""Fresh prompts replayed from prefill graphs on CUDA (fast/prefill_graph.py): a replay gives
what its capture's called run gave, padded prompts track the called prefill, decoding after
one never reads the padding, a partial expert cache stays called, and the engine gives the
graphs' memory back when it releases memory."""

from __future__ import annotations

import pytest
import torch

from strata.engine.core.fast import GraphDecoder
from strata.engine.core.kv_cache import KVCache
from strata.engine.core.random_weights import build_random_model
from strata.engine.protocol import SamplingSpec
from tests.gpu.gpu_helpers import build_with_expert_cache
from tests.helpers.fast_configs import SMALL_CONFIGS

pytestmark = pytest.mark.gpu

CONFIGS = SMALL_CONFIGS
GREEDY = SamplingSpec(max_tokens=64, temperature=0.0)
PROMPT = [(11 * i + 5) % 512 for i in range(40)]


def decoders(name: str):
    """(with prefill graphs up to 256 tokens, without), over one bf16 model."""
    model = build_random_model(CONFIGS[name], "cuda", torch.bfloat16, seed=0, std=0.1)
    graphed = GraphDecoder(model, prefill_chunk_tokens=256)
    graphed.enable_prefill_graphs(256)
    return graphed, GraphDecoder(model, prefill_chunk_tokens=256)


def cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a.float().flatten(1), b.float().flatten(1), -1)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_replays_match_their_capture_and_the_called_prefill(name) -> None:
    graphed, called = decoders(name)
    kv = KVCache.for_config(graphed.model.config, 256, torch.bfloat16, "cuda")
    kv_ref = KVCache.for_config(graphed.model.config, 256, torch.bfloat16, "cuda")
    for num_tokens in (1, 13, 64, 200):
        ids = torch.tensor((PROMPT * 5)[:num_tokens], device="cuda")
        first = graphed.prefill(kv, ids, 0)  # called on a side stream, then captured
        replayed = graphed.prefill(kv, ids, 0)
        torch.testing.assert_close(replayed, first, rtol=1e-3, atol=1e-3)
        ref = called.prefill(kv_ref, ids, 0)
        assert cosine(ref[None], replayed[None]) > 0.999
        assert graphed.prefill_reach(kv, num_tokens, 0) >= num_tokens
        for k_ref, k in zip(kv_ref.k, kv.k, strict=True):
            rows = cosine(k_ref[:num_tokens], k[:num_tokens])
            # A bf16 near-tie in routing may move one token's row (as in test_decode_fast).
            assert rows.mean() > 0.995 and rows.min() > 0.8, (rows.mean(), rows.min())
    assert len(graphed.prefill_graphs) == 3  # buckets 16 (1 and 13 tokens), 64 and 256
    # After cached tokens, or past the graphs' length: called, nothing new captured.
    graphed.prefill(kv, torch.tensor(PROMPT[:8], device="cuda"), 200)
    assert len(graphed.prefill_graphs) == 3
    assert graphed.prefill_reach(kv, 8, 200) == 208


@pytest.mark.parametrize("name", list(CONFIGS))
def test_decoding_after_a_padded_prompt_equals_the_called_path(name) -> None:
    """PROMPT's 40 tokens pad to 64: decoding from 40 overwrites the padding's K/V before any
    step reads it, so greedy tokens match a called prefill's (bf16 near-ties aside)."""
    graphed, called = decoders(name)
    # Graphs are keyed by the KV's addresses (fixed in the engine's arena): the second graphed
    # run reuses its KV, so it replays the first run's graph.
    kv_graphed, kv_called = (KVCache.for_config(d.model.config, 256, torch.bfloat16, "cuda")
                             for d in (graphed, called))
    tokens = []
    for decoder, kv in ((graphed, kv_graphed), (called, kv_called), (graphed, kv_graphed)):
        tokens.append(list(decoder.generate(kv, PROMPT, GREEDY, 30)))
    assert len(graphed.prefill_graphs) == 1
    assert tokens[2] == tokens[0]
    same = sum(a == b for a, b in zip(tokens[0], tokens[1], strict=True))
    assert same >= 27, tokens


def test_a_partial_expert_cache_prefills_called() -> None:
    memory, model = build_with_expert_cache(CONFIGS["qwen3_moe"], "24")
    try:
        decoder = GraphDecoder(model, prefill_chunk_tokens=256)
        assert decoder.plan_prefill_graphs() == {}  # the expert loop asks the host
        decoder.enable_prefill_graphs(256)
        kv = KVCache.for_config(model.config, 256, torch.bfloat16, "cuda")
        logits = decoder.prefill(kv, torch.tensor(PROMPT, device="cuda"), 0)
        assert torch.isfinite(logits).all()
        assert len(decoder.prefill_graphs) == 0
        assert decoder.prefill_reach(kv, len(PROMPT), 0) == len(PROMPT)
    finally:
        memory.close()


def test_load_plans_graphs_from_measured_times() -> None:
    model = build_random_model(CONFIGS["llama"], "cuda", torch.bfloat16, seed=0, std=0.1)
    decoder = GraphDecoder(model, prefill_chunk_tokens=1024)
    found = decoder.tune_prefill()["graphs"]
    # A 3-layer model's GPU work is tiny next to any host time: the whole chunk takes graphs.
    assert found["graph_tokens"] == 1024, found
    assert 0 < found["chunk_replay_s"] < found["host_s"], found
    assert decoder.prefill_graphs.max_tokens == 1024
    assert len(decoder.prefill_graphs) == 0  # the probe's graph went with its scratch cache
