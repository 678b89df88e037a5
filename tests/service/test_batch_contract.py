"""The batching contract of the engine process (BATCH_CONTRACT.md, protocol 4), fake and real
engine side by side: Generates that overlap all end with their own Done, Done.slot names the
slot a sequence used (the engine picks it for slot None), and the status reports the batch.

The status fields (EngineStatus.num_slots, .batch, SlotStatus.is_running) are the contract's;
protocol.EngineStatus carries them once the engine side adds them."""

from __future__ import annotations

import pytest
from fakes.fake_engine import FAKE_ENGINE_FACTORY, FakeEngineConfig

from strata.default_model import DefaultModelError, default_model_path
from strata.engine import protocol as p
from strata.engine.core.engine_config import EngineConfig
from strata.engine.core.process import DEFAULT_ENGINE_FACTORY

from .test_engine_process import RawEngine

pytestmark = pytest.mark.timeout(180)


def engines():
    try:
        model = str(default_model_path(fetch=False))
    except DefaultModelError:
        model = None
    yield "fake", FAKE_ENGINE_FACTORY, FakeEngineConfig(num_slots=3), "fake-model"
    if model is not None:
        yield ("real", DEFAULT_ENGINE_FACTORY,
               EngineConfig(model_path=model, device="cpu", context_tokens=512, num_slots=3),
               model)


@pytest.fixture(params=list(engines()), ids=[e[0] for e in engines()])
def engine(request):
    _, factory, config, model = request.param
    engine = RawEngine(config, factory=factory)
    try:
        assert isinstance(engine.recv(timeout_s=60), p.Ready)
        engine.send(p.Load(model_path=model, device="cpu", context_tokens=512))
        assert isinstance(engine.recv(timeout_s=120), p.Reply)
        yield engine
    finally:
        engine.process.kill()
        engine.process.join(10)


def finals_of(engine: RawEngine, request_ids: set[str]) -> dict[str, p.Done | p.Error]:
    """Read events until every request has its final event; Tokens must name one of them."""
    finals: dict[str, p.Done | p.Error] = {}
    while set(finals) != request_ids:
        event = engine.recv(timeout_s=60)
        if isinstance(event, (p.Tokens, p.Done, p.Error)):
            assert event.request_id in request_ids, event
        if isinstance(event, (p.Done, p.Error)):
            finals[event.request_id] = event
    return finals


def test_the_status_reports_the_slots_and_the_batch(engine):
    engine.send(p.GetStatus())
    status = engine.recv(timeout_s=30).engine
    assert status.num_slots == 3
    batch = status.batch
    assert (batch.running, batch.waiting, batch.parallel) == (0, 0, 3)
    assert [row.id for row in status.slots] == [0, 1, 2]
    assert all(row.is_running is False for row in status.slots)


def test_overlapping_generates_each_end_and_done_names_the_slot(engine):
    spec = p.SamplingSpec(max_tokens=6, temperature=0.0)
    prompts = {"a": (1, 9, 42, 7), "b": (1, 17, 23, 5), "c": (1, 4, 4, 4)}
    for request_id, prompt in prompts.items():
        engine.send(p.Generate(request_id, prompt, spec, slot=None))  # the engine picks
    finals = finals_of(engine, set(prompts))
    assert all(isinstance(final, p.Done) for final in finals.values()), finals
    slots = {rid: final.slot for rid, final in finals.items()}
    assert all(isinstance(s, int) and 0 <= s < 3 for s in slots.values()), slots
    assert len(set(slots.values())) == 3, f"three new prompts share no prefix: {slots}"
    # An explicit slot still wins, and Done says so.
    engine.send(p.Generate("d", prompts["a"], spec, slot=2))
    assert finals_of(engine, {"d"})["d"].slot == 2


def test_a_cancelled_sequence_ends_with_done_cancelled_and_its_slot(engine):
    long_spec = p.SamplingSpec(max_tokens=400, temperature=0.0)
    engine.send(p.Generate("keep", (1, 9, 42, 7), p.SamplingSpec(max_tokens=8), slot=None))
    engine.send(p.Generate("drop", (1, 17, 23, 5), long_spec, slot=None))
    engine.send(p.Cancel("drop"))
    finals = finals_of(engine, {"keep", "drop"})
    assert finals["drop"].usage.finish_reason == "cancelled"
    assert finals["keep"].usage.finish_reason in ("length", "stop")
    engine.send(p.GetStatus())
    status = engine.recv(timeout_s=30).engine
    assert status.batch.running == 0
    assert not any(row.is_running for row in status.slots)
