"""PromptProgress through the real engine process (llama.cpp's return_progress): a report when
the sequence gets its slot and one per prefill chunk, all before its first token; none for a
request that did not ask."""

from __future__ import annotations

import pytest

from strata.engine import protocol as p
from strata.engine.core.engine_config import EngineConfig
from strata.engine.core.process import DEFAULT_ENGINE_FACTORY
from tests.snapshots.helpers import VOCAB, save_tiny_llama

from .test_engine_process import RawEngine

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

CHUNK_TOKENS = 16
PROMPT = tuple(range(3, 43))  # 40 tokens: chunks of 16, 16 and 8


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model_dir = save_tiny_llama(tmp_path_factory.mktemp("tiny"), seed=0)
    assert max(PROMPT) < VOCAB
    config = EngineConfig(model_path=str(model_dir), device="cpu", context_tokens=128,
                          prefill_chunk_tokens=CHUNK_TOKENS, prefill_solo_chunk_tokens=0)
    raw = RawEngine(config, factory=DEFAULT_ENGINE_FACTORY)
    try:
        assert isinstance(raw.recv(timeout_s=60), p.Ready)
        raw.send(p.Load(model_path=str(model_dir), context_tokens=128, device="cpu"))
        reply = raw.recv(timeout_s=120)
        assert isinstance(reply, p.Reply), reply
        yield raw
    finally:
        raw.process.kill()
        raw.process.join(10)


def _run(engine: RawEngine, request_id: str, **sampling) -> list:
    spec = p.SamplingSpec(max_tokens=3, **sampling)
    engine.send(p.Generate(request_id, PROMPT, spec, slot=0))
    events = engine.until_final(request_id)
    assert isinstance(events[-1], p.Done), events[-1]
    return events


def test_a_prompt_reports_its_slot_and_every_chunk_before_its_first_token(engine):
    events = _run(engine, "cold", return_progress=True, reuse_cache=False)
    first_token = next(i for i, e in enumerate(events) if isinstance(e, p.Tokens))
    reports = [e for e in events if isinstance(e, p.PromptProgress)]
    assert all(isinstance(e, p.PromptProgress) for e in events[:first_token])
    assert [r.processed for r in reports] == [0, 16, 32, 40]
    assert {(r.total, r.cached) for r in reports} == {(40, 0)}
    assert reports[0].prefill_s == 0.0  # nothing evaluated yet
    times = [r.prefill_s for r in reports]
    assert times == sorted(times) and times[-1] > 0


def test_the_reused_prefix_is_the_first_report(engine):
    _run(engine, "warm-up")
    reports = [e for e in _run(engine, "warm", return_progress=True)
               if isinstance(e, p.PromptProgress)]
    # All but the last token are reused (its logits give the first token): one chunk left.
    assert [(r.cached, r.processed) for r in reports] == [(39, 39), (39, 40)]


def test_a_request_that_did_not_ask_gets_no_reports(engine):
    events = _run(engine, "quiet", reuse_cache=False)
    assert not [e for e in events if isinstance(e, p.PromptProgress)]
    assert sum(len(e.token_ids) for e in events if isinstance(e, p.Tokens)) == 3
