"""The synchronous Engine: greedy parity with transformers, prefix reuse, cancel, bad input."""

from __future__ import annotations

import pytest
import torch

from strata.engine.core.engine import Engine, EngineConfig, EngineError
from strata.engine.protocol import SamplingSpec
from tests.helpers.tiny_models import make_tiny_hf_model

GREEDY = SamplingSpec(max_tokens=20, temperature=0.0)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    path, hf_model = make_tiny_hf_model("llama", tmp_path_factory.mktemp("models"))
    engine = Engine(EngineConfig(model_path=str(path), device="cpu"))
    engine.load()
    return engine, hf_model


def run(engine: Engine, prompt, spec=GREEDY, slot=0) -> list[int]:
    return [t for ids in engine.generate(prompt, spec, slot=slot) for t in ids]


def hf_greedy(hf_model, prompt: list[int], n: int) -> list[int]:
    out = hf_model.generate(
        torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False
    )
    return out[0, len(prompt) :].tolist()


def test_greedy_equals_transformers(tiny_llama) -> None:
    engine, hf_model = tiny_llama
    prompt = list(range(3, 40))
    assert run(engine, prompt) == hf_greedy(hf_model, prompt, 20)
    usage = engine.last_usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.finish_reason) == (37, 20, "length")


def test_prefix_reuse_counts_tokens_and_matches_a_cold_run(tiny_llama) -> None:
    engine, hf_model = tiny_llama
    first = list(range(50, 90))
    answer = run(engine, first, slot=1)
    assert engine.last_usage.cached_tokens == 0
    # The follow-up holds the first prompt, the answer and a new turn, like a chat history.
    second = first + answer + [7, 8, 9]
    warm = run(engine, second, slot=1)
    # Every token whose K/V was computed is reused: the prompt and all answers but the last.
    assert engine.last_usage.cached_tokens == len(first) + len(answer) - 1
    assert warm == hf_greedy(hf_model, second, 20)


def test_repeating_a_prompt_reuses_all_but_its_last_token(tiny_llama) -> None:
    engine, _ = tiny_llama
    prompt = list(range(100, 130))
    cold = run(engine, prompt, slot=2)
    again = run(engine, prompt, slot=2)
    assert again == cold
    assert engine.last_usage.cached_tokens == len(prompt) - 1


def test_slots_are_independent(tiny_llama) -> None:
    engine, _ = tiny_llama
    a, b = list(range(10, 40)), list(range(200, 230))
    run(engine, a, slot=0)
    run(engine, b, slot=3)
    run(engine, [*a, 5], slot=0)
    assert engine.last_usage.cached_tokens == len(a)


def test_cancel_leaves_the_slot_consistent(tiny_llama) -> None:
    engine, hf_model = tiny_llama
    prompt = list(range(60, 100))
    gen = engine.generate(prompt, GREEDY, slot=1)
    got = [next(gen)[0] for _ in range(5)]
    gen.close()
    assert engine.last_usage.finish_reason == "cancelled"
    assert engine.last_usage.completion_tokens == 5
    follow = prompt + got + [11, 12]
    assert run(engine, follow, slot=1) == hf_greedy(hf_model, follow, 20)
    assert engine.last_usage.cached_tokens >= len(prompt)


def test_stop_token_ends_generation(tiny_llama) -> None:
    engine, hf_model = tiny_llama
    prompt = list(range(3, 40))
    expected = hf_greedy(hf_model, prompt, 20)
    stop = expected[4]
    spec = SamplingSpec(max_tokens=20, stop_token_ids=(stop,))
    out = run(engine, prompt, spec)
    assert out == expected[: expected.index(stop) + 1]
    assert engine.last_usage.finish_reason == "stop"


def test_seeded_sampling_is_reproducible(tiny_llama) -> None:
    engine, _ = tiny_llama
    spec = SamplingSpec(max_tokens=15, temperature=0.9, top_p=0.95, top_k=50, seed=42)
    prompt = list(range(20, 45))
    assert run(engine, prompt, spec) == run(engine, prompt, spec)


@pytest.mark.parametrize(
    "prompt, message",
    [([], "prompt is empty"), ([1, 100000], "token ids must be in"), ([1] * 300, "context is 256")],
)
def test_bad_prompts_are_refused(tiny_llama, prompt, message) -> None:
    engine, _ = tiny_llama
    with pytest.raises(EngineError, match=message):
        run(engine, prompt)


def test_bad_slot_is_refused(tiny_llama) -> None:
    engine, _ = tiny_llama
    with pytest.raises(EngineError, match=r"cache slot must be 0..3"):
        run(engine, [1, 2, 3], slot=4)
