"""Continuous batching on CUDA: the batched eager forward (linear layers on [B, hidden], the
quantized kernels at M = B) gives each sequence the tokens it gets alone on the graph decoder,
and a sequence moves between the graph path (alone) and the batched path at step boundaries.

bf16 rounding differs between the two paths, so a divergence is accepted where it is a
near-tie of the two tokens' logits (batch_helpers.assert_same_or_near_tie).
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from strata.engine.core.engine import Engine, EngineConfig
from strata.engine.protocol import SamplingSpec
from tests.core.batch_helpers import BF16_NEAR_TIE, alone, assert_same_or_near_tie, run_batch
from tests.helpers.tiny_models import make_tiny_hf_model

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", params=["llama", "qwen3_moe"])
def engine(request, tmp_path_factory):
    path, _ = make_tiny_hf_model(request.param, tmp_path_factory.mktemp(request.param))
    engine = Engine(EngineConfig(model_path=str(path), device="cuda", num_slots=8,
                                 prefill_chunk_tokens=16))
    engine.load()
    assert engine.fast is not None, "the graph decoder should run on CUDA"
    yield engine
    engine.close()


def prompts(n: int) -> list[list[int]]:
    return [[(7 * i + 3 * j) % 300 + 5 for j in range(10 + 9 * i)] for i in range(n)]


def test_a_batch_on_cuda_equals_each_sequence_alone(engine) -> None:
    specs = [SamplingSpec(max_tokens=8 + 2 * i) for i in range(8)]
    expected = [alone(engine, p, s, i) for i, (p, s) in enumerate(zip(prompts(8), specs))]
    batch = run_batch(engine, {f"r{i}": (p, s, None) for i, (p, s) in
                               enumerate(zip(prompts(8), specs))})
    for i, prompt in enumerate(prompts(8)):
        assert_same_or_near_tie(engine, prompt, expected[i], batch.tokens[f"r{i}"],
                                BF16_NEAR_TIE)
    for slot in range(8):
        engine.erase_slot(slot)


def test_a_sequence_moves_between_the_graph_and_the_batched_path(engine) -> None:
    long_prompt, short_prompt = prompts(2)
    long_spec, short_spec = SamplingSpec(max_tokens=40), SamplingSpec(max_tokens=5)
    expected_long = alone(engine, long_prompt, long_spec, 0)
    expected_short = alone(engine, short_prompt, short_spec, 1)
    runner = engine._runner
    engine.add("long", long_prompt, long_spec, 0)
    got = {"long": [], "short": []}
    paths = []  # per step: is the graph decoder's stream open (running "long")?
    is_short_added = False
    while engine.has_work:
        if not is_short_added and len(got["long"]) == 10:
            engine.add("short", short_prompt, short_spec, 1)
            is_short_added = True
        for event in engine.step():
            got[event.request_id] += event.token_ids
        paths.append(runner.stream is not None)
    assert_same_or_near_tie(engine, long_prompt, expected_long, got["long"], BF16_NEAR_TIE)
    assert_same_or_near_tie(engine, short_prompt, expected_short, got["short"], BF16_NEAR_TIE)
    # Prefill, graphs alone, batched while both decoded, graphs again once the short one
    # ended, closed at the end.
    runs = [paths[0]] + [b for a, b in itertools.pairwise(paths) if a != b]
    assert runs == [False, True, False, True, False]
    engine.erase_slot(0), engine.erase_slot(1)


def test_sampled_and_cancelled_sequences_switch_cleanly(engine) -> None:
    spec = SamplingSpec(max_tokens=30, temperature=0.8, top_p=0.9, seed=3, repeat_penalty=1.3)
    engine.add("a", prompts(1)[0], spec, 2)
    for _ in range(5):
        engine.step()  # alone: graph decoder
    engine.add("b", prompts(2)[1], spec, 3)
    for _ in range(5):
        engine.step()  # batched
    event = engine.cancel("b")
    assert event.usage.finish_reason == "cancelled"
    tokens = []
    while engine.has_work:
        for event in engine.step():
            tokens += event.token_ids
            usage = event.usage
    assert usage.completion_tokens == 30
    assert all(0 <= t < engine.model_config.vocab_size for t in tokens)
    engine.erase_slot(2), engine.erase_slot(3)


def test_the_default_model_quantized_batch_equals_alone(smollm2_gguf: Path, smollm2) -> None:
    engine = Engine(EngineConfig(model_path=str(smollm2_gguf), device="cuda", num_slots=8,
                                 context_tokens=1024))
    engine.load()
    try:
        questions = ["What is the capital of France?", "Name three colours.",
                     "What is 2 + 2?", "Write a haiku about rain.", "Who wrote Hamlet?",
                     "What is water made of?", "Say hello in Spanish.", "Count to five."]
        spec = SamplingSpec(max_tokens=32, stop_token_ids=tuple(smollm2.eos_token_ids))
        chats = [smollm2.encode_chat([{"role": "user", "content": q}]) for q in questions]
        expected = [alone(engine, p, spec, i) for i, p in enumerate(chats)]
        batch = run_batch(engine, {f"c{i}": (p, spec, None) for i, p in enumerate(chats)})
        for i, prompt in enumerate(chats):
            assert_same_or_near_tie(engine, prompt, expected[i], batch.tokens[f"c{i}"],
                                    BF16_NEAR_TIE)
    finally:
        engine.close()
