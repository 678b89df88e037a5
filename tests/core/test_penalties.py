"""Penalties, logit bias, min_p and logprobs of both samplers, against numpy references."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from strata.engine.core.fast import GraphDecoder
from strata.engine.core.fast.graph_sampler import GraphSampler, sampling_key
from strata.engine.core.kv_cache import KVCache
from strata.engine.core.penalties import TokenWindow
from strata.engine.core.random_weights import build_random_model
from strata.engine.core.sampling import Sampler
from strata.engine.protocol import SamplingSpec
from tests.helpers.fast_configs import TINY_CONFIGS

CPU = torch.device("cpu")
VOCAB = 40
PENALISED = SamplingSpec(temperature=0.0, repeat_penalty=1.3, presence_penalty=0.4,
                         frequency_penalty=0.25, penalty_last_n=6)


def numpy_penalties(logits: np.ndarray, window: list[int], repeat: float, presence: float,
                    frequency: float) -> np.ndarray:
    """llama.cpp's llama_sampler_penalties_apply, token by token."""
    out = logits.astype(np.float64).copy()
    counts: dict[int, int] = {}
    for token in window:
        counts[token] = counts.get(token, 0) + 1
    for token, count in counts.items():
        out[token] = out[token] * repeat if out[token] <= 0 else out[token] / repeat
        out[token] -= count * frequency + presence
    return out


def flat(record) -> list[float]:
    """A TokenLogprob as numbers, for approximate comparison."""
    return [record.token_id, record.logprob, *(x for pair in record.top for x in pair)]


def random_logits(seed: int) -> torch.Tensor:
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)) * 2


def test_penalties_match_llama_cpp_over_the_last_n_tokens() -> None:
    history = [3, 5, 5, 7, 1, 2, 3, 3, 9, 11]  # the window is the last 6: 2 3 3 9 11 + none
    sampler = Sampler(PENALISED, CPU, VOCAB, history)
    logits = random_logits(0)
    got = sampler.adjust(logits).numpy()
    want = numpy_penalties(logits.numpy(), history[-6:], 1.3, 0.4, 0.25)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert got[5] == pytest.approx(float(logits[5]))  # 5 left the window: untouched


def test_window_slides_as_tokens_are_sampled() -> None:
    window = TokenWindow(VOCAB, 4, CPU)
    window.reset([1, 2, 3], 4)
    seen = [1, 2, 3]
    for token in [4, 1, 1, 7, 2, 9]:
        window.push(torch.tensor([token]))
        seen.append(token)
        want = np.bincount(seen[-4:], minlength=VOCAB)
        np.testing.assert_array_equal(window.counts.numpy(), want)


def test_last_n_minus_one_counts_the_whole_history() -> None:
    spec = SamplingSpec(temperature=0.0, presence_penalty=1.0, penalty_last_n=-1, max_tokens=4)
    history = list(range(30))
    sampler = Sampler(spec, CPU, VOCAB, history)
    logits = torch.zeros(VOCAB)
    adjusted = sampler.adjust(logits)
    assert (adjusted[:30] == -1.0).all() and (adjusted[30:] == 0.0).all()


def test_repeat_penalty_steers_greedy_away_from_a_repeat() -> None:
    logits = torch.tensor([0.0, 2.0, 1.9, -1.0])
    plain = Sampler(SamplingSpec(temperature=0.0), CPU, 4, [1])
    penalised = Sampler(SamplingSpec(temperature=0.0, repeat_penalty=1.2), CPU, 4, [1])
    assert int(plain(logits)) == 1
    assert int(penalised(logits)) == 2  # 2.0 / 1.2 < 1.9
    assert int(penalised(logits)) == 1  # 2 is now in the window too: 1.9/1.2 < 2.0/1.2


def test_logit_bias_bans_and_forces_tokens() -> None:
    logits = torch.tensor([0.0, 5.0, 1.0, -2.0])
    ban = SamplingSpec(temperature=0.0, logit_bias=((1, -100.0),))
    force = SamplingSpec(temperature=1.0, seed=3, logit_bias=((3, 100.0),))
    assert int(Sampler(ban, CPU, 4)(logits)) == 2
    forced = Sampler(force, CPU, 4)
    assert {int(forced(logits)) for _ in range(50)} == {3}


def numpy_filtered(logits: np.ndarray, temperature: float, top_k: int, min_p: float,
                   top_p: float) -> np.ndarray:
    """Strata's chain: temperature, top-k, softmax, min-p (relative to the top), top-p."""
    scaled = logits.astype(np.float64) / temperature
    if top_k:
        kth = np.sort(scaled)[-top_k]
        scaled = np.where(scaled < kth, -np.inf, scaled)
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    probs = np.where(probs < probs.max() * min_p, 0.0, probs)
    order = np.argsort(-probs, kind="stable")
    before = np.cumsum(probs[order]) - probs[order]
    kept = np.zeros_like(probs)
    kept[order] = np.where(before >= top_p, 0.0, probs[order])
    return kept / kept.sum()


@pytest.mark.parametrize("temperature,top_k,min_p,top_p", [
    (0.8, 40, 0.05, 0.95), (1.0, 0, 0.2, 1.0), (0.5, 10, 0.1, 0.9), (1.5, 0, 0.3, 0.8)])
def test_min_p_with_the_other_filters_matches_numpy(temperature, top_k, min_p, top_p) -> None:
    spec = SamplingSpec(temperature=temperature, top_k=top_k, min_p=min_p, top_p=top_p)
    logits = random_logits(4)
    got = Sampler(spec, CPU).probabilities(logits).double().numpy()
    want = numpy_filtered(logits.numpy(), temperature, top_k, min_p, top_p)
    np.testing.assert_allclose(got, want, atol=1e-6)
    assert (got > 0).sum() < VOCAB  # the filters really removed tokens


def test_min_p_changes_what_is_drawn() -> None:
    logits = torch.log(torch.tensor([0.6, 0.3, 0.05, 0.05]))
    sampler = Sampler(SamplingSpec(temperature=1.0, min_p=0.2, seed=1), CPU)
    assert {int(sampler(logits)) for _ in range(400)} == {0, 1}


def test_logprobs_are_the_raw_log_softmax_with_the_top_k() -> None:
    spec = SamplingSpec(temperature=0.7, seed=5, num_logprobs=3, logit_bias=((0, 50.0),))
    sampler = Sampler(spec, CPU, VOCAB)
    logits = random_logits(2)
    token = int(sampler(logits))
    reference = torch.log_softmax(logits.double(), -1)
    record = sampler.last_logprob
    assert token == 0  # the bias decided the draw; the logprobs ignore it, as OpenAI's do
    assert record.token_id == 0 and record.logprob == pytest.approx(float(reference[0]), abs=1e-5)
    top_ids = torch.argsort(reference, descending=True)[:3].tolist()
    assert [i for i, _ in record.top] == top_ids
    assert [lp for _, lp in record.top] == pytest.approx(reference[top_ids].tolist(), abs=1e-5)


@pytest.mark.parametrize("spec", [
    PENALISED,
    SamplingSpec(temperature=0.9, top_k=12, min_p=0.05, seed=2, repeat_penalty=1.1,
                 frequency_penalty=0.5, penalty_last_n=-1, max_tokens=20),
    SamplingSpec(temperature=0.0, logit_bias=((7, -100.0), (8, 3.5)), num_logprobs=4),
])
def test_graph_sampler_adjusts_like_the_eager_sampler(spec: SamplingSpec) -> None:
    history = [1, 7, 7, 8, 2]
    eager = Sampler(spec, CPU, VOCAB, history)
    graph = GraphSampler(VOCAB, CPU, max_window_tokens=64)
    graph.prepare(spec, history)
    key = sampling_key(spec)
    for step in range(8):
        logits = random_logits(10 + step)
        torch.testing.assert_close(graph.adjust(logits, key).float(), eager.adjust(logits))
        if key[0] == "sample":
            torch.testing.assert_close(graph.probabilities(graph.adjust(logits, key), key),
                                       eager.probabilities(eager.adjust(logits)))
        token = int(eager(logits))
        if key[0] == "greedy":
            assert int(graph.sample(logits[None], key)) == token
        else:  # the draws differ (other noise): feed the eager token to both windows
            if "penalties" in key:
                graph.window.push(torch.tensor([token]))
        if spec.num_logprobs is not None:
            assert flat(graph.read_logprob(token)) == pytest.approx(flat(eager.last_logprob))


def test_graph_decoder_applies_penalties_bias_and_logprobs_like_the_eager_path() -> None:
    """The decoder's step (eager here, the same code a CUDA graph captures) against the
    reference forward driven by the eager Sampler."""
    model = build_random_model(TINY_CONFIGS["llama"], "cpu", torch.float32, seed=0, std=0.15)
    prompt = [(5 * i + 2) % 96 for i in range(12)]
    spec = SamplingSpec(temperature=0.0, repeat_penalty=1.5, presence_penalty=0.5,
                        penalty_last_n=8, logit_bias=((3, 2.0),), num_logprobs=2)
    kv = KVCache.for_config(model.config, 40)
    sampler = Sampler(spec, CPU, model.config.vocab_size, prompt)
    want, records = [], []
    with torch.inference_mode():
        logits = model(torch.tensor(prompt), 0, kv)[-1]
        for i in range(10):
            want.append(int(sampler(logits)))
            records.append(sampler.last_logprob)
            logits = model(torch.tensor(want[-1:]), len(prompt) + i, kv)[-1]
    plain = Sampler(SamplingSpec(temperature=0.0), CPU)
    decoder = GraphDecoder(model, min_bucket_tokens=8, prefill_chunk_tokens=8)
    got, got_records = [], []
    for token in decoder.generate(KVCache.for_config(model.config, 40), prompt, spec, 10):
        got.append(token)
        got_records.append(decoder.last_logprob)
    assert got == want
    got_numbers = [x for r in got_records for x in flat(r)]
    assert got_numbers == pytest.approx([x for r in records for x in flat(r)], abs=1e-4)
    unpenalised = list(decoder.generate(KVCache.for_config(model.config, 40), prompt,
                                        SamplingSpec(temperature=0.0), 10))
    assert unpenalised != got, "the penalties changed nothing: the test proves nothing"
    assert plain.last_logprob is None


@pytest.mark.parametrize("spec", [
    SamplingSpec(temperature=0.8, top_k=10, top_p=0.95, min_p=0.05, seed=1),
    SamplingSpec(temperature=1.3, top_k=25, seed=2),
    SamplingSpec(temperature=0.6, top_k=5, top_p=0.7, seed=3, presence_penalty=0.5),
])
def test_graph_sampler_top_k_draw_equals_the_full_vocabulary_draw(spec: SamplingSpec) -> None:
    """The top-k shortcut draws what argmax(probabilities / noise) over the vocabulary does."""
    from strata.engine.core.fast.graph_sampler import exponential_noise

    sampler = GraphSampler(VOCAB, CPU)
    sampler.prepare(spec, [1, 2, 3])
    key = sampling_key(spec)
    for step in range(40):
        logits = random_logits(100 + step)
        adjusted = sampler.adjust(logits, key)
        probs = sampler.probabilities(adjusted, key)
        noise = exponential_noise(sampler.seed, sampler.step, sampler.token_index)
        want = int(torch.argmax(probs / noise))
        assert int(sampler.sample(logits[None], key)) == want
