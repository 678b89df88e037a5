"""Sampling filters and seeding, checked on exact distributions."""

from __future__ import annotations

import torch

from strata.engine.core.sampling import Sampler
from strata.engine.protocol import SamplingSpec

CPU = torch.device("cpu")
LOGITS = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03]))


def probs(**kw) -> torch.Tensor:
    return Sampler(SamplingSpec(temperature=1.0, **kw), CPU).probabilities(LOGITS)


def test_greedy_is_argmax() -> None:
    sampler = Sampler(SamplingSpec(temperature=0.0), CPU)
    assert int(sampler(torch.tensor([0.1, 3.0, -1.0]))) == 1


def test_temperature_one_keeps_the_distribution() -> None:
    torch.testing.assert_close(probs(), torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03]))


def test_top_k_keeps_k_tokens() -> None:
    p = probs(top_k=2)
    torch.testing.assert_close(p, torch.tensor([2 / 3, 1 / 3, 0.0, 0.0, 0.0]))


def test_top_p_keeps_the_smallest_prefix_reaching_p() -> None:
    p = probs(top_p=0.7)  # 0.5 < 0.7 <= 0.75: two tokens
    torch.testing.assert_close(p, torch.tensor([2 / 3, 1 / 3, 0.0, 0.0, 0.0]))
    p = probs(top_p=0.1)  # the top token always stays
    torch.testing.assert_close(p, torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0]))


def test_min_p_drops_tokens_below_a_fraction_of_the_top() -> None:
    p = probs(min_p=0.2)  # floor 0.1: keeps 0.5, 0.25, 0.15
    torch.testing.assert_close(p, torch.tensor([0.5, 0.25, 0.15, 0.0, 0.0]) / 0.9)


def test_same_seed_same_draws_and_draws_follow_the_distribution() -> None:
    spec = SamplingSpec(temperature=1.0, seed=1234)
    a = [int(Sampler(spec, CPU)(LOGITS)) for _ in range(1)]
    s1, s2 = Sampler(spec, CPU), Sampler(spec, CPU)
    draws1 = [int(s1(LOGITS)) for _ in range(4000)]
    draws2 = [int(s2(LOGITS)) for _ in range(4000)]
    assert draws1 == draws2 and a[0] == draws1[0]
    freq = torch.bincount(torch.tensor(draws1), minlength=5).float() / len(draws1)
    torch.testing.assert_close(freq, torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03]), atol=0.03, rtol=0)
