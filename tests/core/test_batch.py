"""Continuous batching in the engine core (add / step / cancel) on tiny random models, CPU.

Batched greedy tokens equal each request run alone; requests join mid-run, wait for a busy
explicit slot, cancel and free their slot; slots without an explicit id are chosen by prefix;
a long prompt is prefilled a chunk per step while another sequence keeps decoding.
"""

from __future__ import annotations

import itertools

import pytest

from strata.engine.core.batch.sequence import Phase
from strata.engine.core.engine import Engine, EngineConfig, EngineError
from strata.engine.protocol import SamplingSpec
from tests.core.batch_helpers import alone, assert_same_or_near_tie, run_batch
from tests.helpers.tiny_models import make_tiny_hf_model

GREEDY = SamplingSpec(max_tokens=12)


def load(path, **config) -> Engine:
    engine = Engine(EngineConfig(model_path=str(path), device="cpu", **config))
    engine.load()
    return engine


@pytest.fixture(scope="module", params=["llama", "qwen3_moe"])
def engine8(request, tmp_path_factory):
    """Eight slots, all running together; chunks of 16 so prompts take several steps."""
    path, _ = make_tiny_hf_model(request.param, tmp_path_factory.mktemp(request.param))
    engine = load(path, num_slots=8, prefill_chunk_tokens=16)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory):
    path, _ = make_tiny_hf_model("llama", tmp_path_factory.mktemp("llama"))
    return path


def prompts(n: int) -> list[list[int]]:
    return [[(7 * i + 3 * j) % 300 + 5 for j in range(10 + 9 * i)] for i in range(n)]


def test_eight_sequences_in_one_batch_equal_each_run_alone(engine8) -> None:
    engine = engine8
    specs = [SamplingSpec(max_tokens=8 + 2 * i) for i in range(8)]  # mixed lengths too
    expected = [alone(engine, p, s, i) for i, (p, s) in enumerate(zip(prompts(8), specs))]
    batch = run_batch(engine, {f"r{i}": (p, s, None) for i, (p, s) in
                               enumerate(zip(prompts(8), specs))})
    for i, prompt in enumerate(prompts(8)):
        assert_same_or_near_tie(engine, prompt, expected[i], batch.tokens[f"r{i}"])
        usage = batch.usage[f"r{i}"]
        assert (usage.completion_tokens, usage.finish_reason) == (8 + 2 * i, "length")
    assert len(set(batch.slot.values())) == 8  # each its own slot
    for slot in range(8):
        engine.erase_slot(slot)


def test_seeded_sampling_and_logprobs_are_per_sequence(engine8) -> None:
    engine = engine8
    specs = [SamplingSpec(max_tokens=10, temperature=0.9, top_k=40, seed=s, num_logprobs=2)
             for s in (1, 2, 3)]
    expected = [alone(engine, p, s, i) for i, (p, s) in enumerate(zip(prompts(3), specs))]
    batch = run_batch(engine, {f"r{i}": (p, s, i) for i, (p, s) in
                               enumerate(zip(prompts(3), specs))})
    assert [batch.tokens[f"r{i}"] for i in range(3)] == expected
    for i in range(3):
        records = batch.logprobs[f"r{i}"]
        assert [r.token_id for r in records] == expected[i] and len(records[0].top) == 2
        engine.erase_slot(i)


def test_a_request_joins_mid_run_and_leaves_first(llama_path) -> None:
    engine = load(llama_path, num_slots=4)
    long_spec, short_spec = SamplingSpec(max_tokens=30), SamplingSpec(max_tokens=4)
    a, b = list(range(10, 50)), list(range(60, 75))
    expected_a, expected_b = alone(engine, a, long_spec, 0), alone(engine, b, short_spec, 1)
    engine.add("a", a, long_spec, 0)
    got = {"a": [], "b": []}
    usage = {}
    for step in range(40):
        if step == 5:
            engine.add("b", b, short_spec, 1)
        for event in engine.step():
            got[event.request_id] += event.token_ids
            if event.usage is not None:
                usage[event.request_id] = (event.usage, len(got["a"]))
        if not engine.has_work:
            break
    assert got == {"a": expected_a, "b": expected_b}
    # b ran its 4 tokens while a was still going: one step each, side by side.
    assert usage["b"][1] < 30 and usage["a"][0].finish_reason == "length"
    engine.close()


def test_cancel_mid_batch_frees_the_slot_for_a_waiting_request(llama_path) -> None:
    engine = load(llama_path, num_slots=4, parallel=2)
    spec = SamplingSpec(max_tokens=50)
    engine.add("a", list(range(5, 25)), spec, 0)
    engine.add("b", list(range(30, 50)), spec, 1)
    engine.add("c", list(range(60, 80)), spec, 2)  # parallel 2: waits
    for _ in range(4):
        engine.step()
    assert engine.batch_status() == {"running": 2, "waiting": 1, "parallel": 2}
    event = engine.cancel("b")
    assert event.usage.finish_reason == "cancelled" and event.slot == 1
    assert event.usage.completion_tokens == 4
    slots = {row["id"]: row["is_running"] for row in engine.slots_status()}
    assert slots == {0: True, 1: False, 2: False, 3: False}
    engine.step()  # c takes the free lane
    assert engine.batch_status()["running"] == 2
    assert {row["id"] for row in engine.slots_status() if row["is_running"]} == {0, 2}
    waiting = engine.cancel("nobody")
    assert waiting is None
    for rid in ("a", "c"):
        assert engine.cancel(rid).usage.finish_reason == "cancelled"
    assert not engine.has_work and not engine.slots.in_use
    engine.close()


def test_cancel_of_a_waiting_request_has_no_slot(llama_path) -> None:
    engine = load(llama_path, num_slots=2, parallel=1)
    engine.add("a", [1, 2, 3], GREEDY, None)
    engine.add("b", [4, 5, 6], GREEDY, None)
    engine.step()
    event = engine.cancel("b")
    assert (event.slot, event.usage.completion_tokens, event.usage.finish_reason) == (
        None, 0, "cancelled")
    engine.close()


def test_an_explicit_slot_waits_while_a_running_sequence_holds_it(llama_path) -> None:
    engine = load(llama_path, num_slots=4)
    first = list(range(100, 140))
    engine.add("a", first, SamplingSpec(max_tokens=6), 2)
    engine.step()
    engine.step()
    follow_up = [*first, 9, 9]
    engine.add("b", follow_up, SamplingSpec(max_tokens=3), 2)
    is_a_done, steps_b_waited, usage_b = False, 0, None
    while engine.has_work:
        if not is_a_done:
            # A free lane (4 slots, 1 running), but b wants the slot a holds.
            assert engine.batch_status() == {"running": 1, "waiting": 1, "parallel": 4}
            steps_b_waited += 1
        for event in engine.step():
            if event.usage is not None:
                is_a_done = is_a_done or event.request_id == "a"
                usage_b = event.usage if event.request_id == "b" else usage_b
    assert steps_b_waited == 4  # a's tokens 3..6
    assert usage_b.cached_tokens == len(first)  # b found a's history in the slot
    engine.close()


def test_slot_choice_keeps_two_alternating_conversations_apart(llama_path) -> None:
    engine = load(llama_path, num_slots=4)
    spec = SamplingSpec(max_tokens=8)
    conversations = {"x": list(range(10, 50)), "y": list(range(150, 190))}
    for turn in range(3):
        for name in ("x", "y"):
            prompt = conversations[name]
            answer = [t for ids in engine.generate(prompt, spec, slot=None) for t in ids]
            cached = engine.last_usage.cached_tokens
            if turn:
                # All but the newest turn's 3 tokens and the previous answer's last token.
                assert cached == len(prompt) - 4, (name, turn, cached)
            conversations[name] = prompt + answer + [turn + 3, turn + 4, turn + 5]
    engine.close()


def test_a_long_prompt_is_prefilled_in_chunks_while_another_decodes(llama_path) -> None:
    engine = load(llama_path, num_slots=2, prefill_chunk_tokens=16)
    short, long_prompt = list(range(5, 20)), [(3 * i) % 300 + 7 for i in range(100)]
    expected_long = alone(engine, long_prompt, GREEDY, 1)
    engine.add("short", short, SamplingSpec(max_tokens=40), 0)
    engine.step()
    engine.add("long", long_prompt, GREEDY, 1)
    prefilled, got_long = [], []
    short_tokens_per_step = []
    while not got_long:
        events = engine.step()
        by_id = {e.request_id: e for e in events}
        short_tokens_per_step.append(len(by_id["short"].token_ids))
        seq = next(s for s in engine.scheduler.running if s.request_id == "long")
        prefilled.append(seq.num_prefilled)
        if "long" in by_id:
            got_long += by_id["long"].token_ids
            assert seq.phase is Phase.DECODE
    # 100 tokens in chunks of 16: 7 steps, the short stream got a token in every one.
    assert prefilled == [16, 32, 48, 64, 80, 96, 100]
    assert short_tokens_per_step == [1] * 7
    while engine.has_work:
        for event in engine.step():
            if event.request_id == "long":
                got_long += event.token_ids
    assert got_long == expected_long
    engine.close()


def test_a_short_prompt_is_prefilled_before_a_long_one_it_arrives_behind(llama_path) -> None:
    """issue 22: a short request during a long prefill waits one chunk, not the whole prompt.
    Alone, the long prompt took solo chunks of 32; with the short one running, chunks of 16."""
    engine = load(llama_path, num_slots=2, prefill_chunk_tokens=16, prefill_solo_chunk_tokens=32)
    long_prompt = [(3 * i) % 300 + 7 for i in range(100)]
    short = list(range(5, 15))
    expected_short = alone(engine, short, GREEDY, 1)
    engine.add("long", long_prompt, GREEDY, 0)
    engine.step()  # the long prompt's first chunk, a solo one
    seq = next(s for s in engine.scheduler.running if s.request_id == "long")
    assert seq.num_prefilled == 32
    engine.add("short", short, GREEDY, 1)
    events = engine.step()  # the short prompt fits this step's chunk: its first token now
    assert [e.request_id for e in events if e.token_ids] == ["short"]
    # The long prompt's partial chunk did not delay the short one's first token: it waited.
    assert seq.num_prefilled == 32
    got_short = list(events[0].token_ids)
    got_short += [t for e in engine.step() if e.request_id == "short" for t in e.token_ids]
    assert seq.num_prefilled == 48
    while engine.has_work:
        for event in engine.step():
            if event.request_id == "short":
                got_short += event.token_ids
    assert got_short == expected_short
    engine.close()


def test_a_prompt_alone_takes_solo_chunks_until_another_request_comes(llama_path) -> None:
    """Alone, a prompt prefills solo_chunk_tokens a step (fewer chunks: each reads every
    weight); once another request waits or runs, chunk_tokens again; greedy tokens as before.
    A solo size below the chunk, or 0, leaves the chunk."""
    long_prompt = [(5 * i) % 300 + 3 for i in range(150)]
    engine = load(llama_path, num_slots=2, prefill_chunk_tokens=16, prefill_solo_chunk_tokens=64)
    expected = alone(engine, long_prompt, GREEDY, 1)
    engine.add("long", long_prompt, GREEDY, 0)
    engine.step()
    seq = next(s for s in engine.scheduler.running if s.request_id == "long")
    assert seq.num_prefilled == 64
    engine.add("other", list(range(5, 40)), SamplingSpec(max_tokens=2), 1)
    assert engine.scheduler.chunk_budget() == 16  # one waits: the small chunk
    engine.step()  # shortest remainder first: the other takes all 16 of this step
    assert seq.num_prefilled == 64
    got = {"long": [], "other": []}
    while engine.has_work:
        for event in engine.step():
            got[event.request_id] += event.token_ids
    assert got["long"] == expected
    engine.close()
    for solo in (0, 8):
        engine = load(llama_path, num_slots=2, prefill_chunk_tokens=16,
                      prefill_solo_chunk_tokens=solo)
        engine.add("long", long_prompt, GREEDY, 0)
        engine.step()
        assert engine.scheduler.running[0].num_prefilled == 16
        engine.close()
    with pytest.raises(ValueError, match="prefill_solo_chunk_tokens must be >= 0"):
        EngineConfig(model_path=str(llama_path), prefill_solo_chunk_tokens=-1)


def test_bad_requests_are_refused_at_add(llama_path) -> None:
    engine = load(llama_path, num_slots=2)
    with pytest.raises(EngineError, match=r"cache slot must be 0\.\.1"):
        engine.add("a", [1, 2], GREEDY, 2)
    engine.add("a", [1, 2], GREEDY, None)
    with pytest.raises(EngineError, match="already running or waiting"):
        engine.add("a", [3, 4], GREEDY, None)
    engine.close()


def test_a_sequence_moves_between_the_graph_decoder_and_the_batch(llama_path) -> None:
    """The GraphDecoder with graphs off runs on the CPU the step its CUDA graphs capture: a
    sequence alone decodes there, moves to the batched forward while another decodes, and
    back once that one ends, its tokens those of a run alone."""
    from strata.engine.core.fast import GraphDecoder

    engine = load(llama_path, num_slots=4, prefill_chunk_tokens=16, prefill_solo_chunk_tokens=0)
    engine.fast = GraphDecoder(engine.model, use_cuda_graphs=False, compile_pointwise=False)
    long_prompt, short_prompt = list(range(10, 50)), list(range(70, 89))
    long_spec = SamplingSpec(max_tokens=30, repeat_penalty=1.3, num_logprobs=1)
    short_spec = SamplingSpec(max_tokens=5)
    expected_long = alone(engine, long_prompt, long_spec, 0)
    expected_short = alone(engine, short_prompt, short_spec, 1)
    engine.add("long", long_prompt, long_spec, 0)
    got, records = {"long": [], "short": []}, []
    paths = []  # per step: is the graph decoder's stream open?
    while engine.has_work:
        if len(got["long"]) == 10 and not got["short"] and engine.batch_status()["running"] == 1:
            engine.add("short", short_prompt, short_spec, 1)
        for event in engine.step():
            got[event.request_id] += event.token_ids
            if event.request_id == "long":
                records += event.logprobs
        paths.append(engine._runner.stream is not None)
    assert_same_or_near_tie(engine, long_prompt, expected_long, got["long"])
    assert got["short"] == expected_short
    assert [r.token_id for r in records] == got["long"]
    # Prefill (3 chunks), alone on the decoder, batched while both decoded, on the decoder
    # again after, closed at the end.
    runs = [paths[0]] + [b for a, b in itertools.pairwise(paths) if a != b]
    assert runs == [False, True, False, True, False] and paths[:4] == [False] * 3 + [True]
    engine.close()
