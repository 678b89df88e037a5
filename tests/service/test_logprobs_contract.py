"""Logprob records through the engine process: the fake engine sends what the real one sends
(one TokenLogprob per token id, the asked number of alternatives), side by side."""

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
    yield "fake", FAKE_ENGINE_FACTORY, FakeEngineConfig(), "fake-model"
    if model is not None:
        yield "real", DEFAULT_ENGINE_FACTORY, EngineConfig(model_path=model, device="cpu"), model


def generate(engine: RawEngine, request_id: str, spec: p.SamplingSpec) -> list[p.Tokens]:
    engine.send(p.Generate(request_id, (1, 9, 42, 7), spec))
    events = engine.until_final(request_id)
    assert isinstance(events[-1], p.Done), events[-1]
    return [e for e in events if isinstance(e, p.Tokens)]


@pytest.mark.parametrize("name,factory,config,model", list(engines()),
                         ids=[e[0] for e in engines()])
def test_tokens_carry_one_logprob_record_per_token(name, factory, config, model):
    engine = RawEngine(config, factory=factory)
    try:
        assert isinstance(engine.recv(timeout_s=60), p.Ready)
        engine.send(p.Load(model_path=model, device="cpu"))
        assert isinstance(engine.recv(timeout_s=120), p.Reply)
        events = generate(engine, "lp", p.SamplingSpec(max_tokens=4, num_logprobs=3))
        for event in events:
            assert len(event.logprobs) == len(event.token_ids)
            for token_id, record in zip(event.token_ids, event.logprobs, strict=True):
                assert isinstance(record, p.TokenLogprob) and record.token_id == token_id
                assert isinstance(record.logprob, float) and record.logprob <= 0.0
                assert len(record.top) == 3
                assert all(isinstance(i, int) and isinstance(lp, float) for i, lp in record.top)
                values = [lp for _, lp in record.top]
                assert values == sorted(values, reverse=True)
                assert record.top[0] == (token_id, record.logprob)  # greedy: the most likely
        assert sum(len(e.token_ids) for e in events) == 4
        plain = generate(engine, "plain", p.SamplingSpec(max_tokens=2))
        assert all(e.logprobs == () for e in plain)
    finally:
        engine.process.kill()
        engine.process.join(10)
