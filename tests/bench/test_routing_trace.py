"""bench/routing_trace.py: the traces the MoE budget benchmark imposes have the properties its
docs claim (k distinct experts, reuse close to p_reuse, popularity by Zipf rank, uniform's
chance reuse), deterministically per seed."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from routing_trace import (
    TraceSpec,
    expert_counts,
    layer_popularity,
    make_trace,
    reuse_fraction,
    zipf_popularity,
)


@pytest.mark.parametrize("routing", ["zipf", "uniform"])
def test_a_trace_is_k_distinct_experts_and_the_seed_fixes_it(routing: str) -> None:
    spec = TraceSpec(routing, zipf_s=1.0, p_reuse=0.5, seed=3)
    trace = make_trace(spec, 200, 4, 32, 6)
    assert trace.shape == (200, 4, 6) and trace.dtype == np.int32
    assert trace.min() >= 0 and trace.max() < 32
    ordered = np.sort(trace, axis=2)
    assert not (ordered[..., 1:] == ordered[..., :-1]).any()  # no expert twice in a token
    assert np.array_equal(trace, make_trace(spec, 200, 4, 32, 6))
    assert not np.array_equal(trace, make_trace(TraceSpec(routing, 1.0, 0.5, seed=4),
                                                200, 4, 32, 6))


@pytest.mark.parametrize("p_reuse", [0.0, 0.3, 0.7])
def test_reuse_fraction_is_close_to_p_reuse(p_reuse: float) -> None:
    # Flat popularity over many experts: a fresh draw lands on the last token's few experts
    # by chance about k / E of the time, so the reuse measured is p_reuse plus that little.
    trace = make_trace(TraceSpec("zipf", zipf_s=0.0, p_reuse=p_reuse, seed=1), 3000, 3, 512, 8)
    assert reuse_fraction(trace) == pytest.approx(p_reuse, abs=0.025)


def test_skew_adds_reuse_by_chance_on_top_of_p_reuse() -> None:
    skewed = make_trace(TraceSpec("zipf", zipf_s=1.2, p_reuse=0.3, seed=2), 2000, 3, 64, 4)
    assert reuse_fraction(skewed) > 0.3 + 0.05


def test_uniform_reuses_only_by_chance() -> None:
    trace = make_trace(TraceSpec("uniform", seed=5), 3000, 4, 128, 8)
    assert reuse_fraction(trace) == pytest.approx(8 / 128, abs=0.01)
    counts = expert_counts(trace, 128)
    assert counts.min() > 0.7 * counts.mean()  # flat: 1500 expected per expert and layer


def test_one_expert_a_token_follows_the_zipf_law_per_layer() -> None:
    num_layers, num_experts, s, seed = 3, 16, 1.2, 7
    trace = make_trace(TraceSpec("zipf", zipf_s=s, p_reuse=0.0, seed=seed), 20000,
                       num_layers, num_experts, 1)
    # The trace draws the layers' rank permutations first from its seed's generator.
    popularity = layer_popularity(num_layers, num_experts, s, np.random.default_rng(seed))
    freq = expert_counts(trace, num_experts) / 20000
    assert np.abs(freq - popularity).max() < 0.012
    # Popular experts differ by layer (a permutation per layer).
    assert len({int(p.argmax()) for p in popularity}) > 1
    assert zipf_popularity(num_experts, s)[0] / zipf_popularity(num_experts, s)[1] == \
        pytest.approx(2 ** s)


def test_top_k_popularity_ranks_follow_the_zipf_ranks() -> None:
    num_experts, seed = 128, 11
    trace = make_trace(TraceSpec("zipf", zipf_s=1.0, p_reuse=0.0, seed=seed), 4000, 2,
                       num_experts, 8)
    popularity = layer_popularity(2, num_experts, 1.0, np.random.default_rng(seed))
    counts = expert_counts(trace, num_experts)
    for layer in range(2):
        by_rank = counts[layer][np.argsort(-popularity[layer])]  # counts, most popular first
        ranks = np.arange(num_experts)
        spearman = np.corrcoef(ranks, np.argsort(np.argsort(-by_rank)))[0, 1]
        assert spearman > 0.9
        assert by_rank[:8].sum() > 10 * by_rank[-8:].sum()  # the head dwarfs the tail


def test_bad_specs_are_refused() -> None:
    with pytest.raises(ValueError, match="routing"):
        TraceSpec("lru")
    with pytest.raises(ValueError, match="p_reuse"):
        TraceSpec("zipf", p_reuse=1.5)
    with pytest.raises(ValueError, match="top_k"):
        make_trace(TraceSpec(), 4, 2, 8, 9)
