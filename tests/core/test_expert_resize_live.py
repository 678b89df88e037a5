"""The expert cache follows a budget live (issue 54): the real engine process (core/process.py,
the real Engine on a 2-layer Qwen3-MoE, CPU) answers ResizeExperts between the steps of a
stream that is decoding, shrinking and growing its cache, and the stream goes on to the same
greedy tokens as an all-resident engine, none lost."""

from __future__ import annotations

import pytest

from strata.engine import protocol as p
from strata.engine.core.engine import Engine, EngineConfig
from strata.engine.core.process import DEFAULT_ENGINE_FACTORY
from tests.core.engine_memory_helpers import NUM_EXPERTS, save_big_expert_moe
from tests.helpers.engine_pipe import EnginePipe

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
PROMPT = tuple(range(3, 23))
NUM_TOKENS = 120
SPEC = p.SamplingSpec(max_tokens=NUM_TOKENS, temperature=0.0)


def test_resize_between_a_streams_tokens_loses_none(tmp_path) -> None:
    model_dir = save_big_expert_moe(tmp_path / "model")
    config = EngineConfig(model_path=str(model_dir), device="cpu", context_tokens=256,
                          snapshot_dir=str(tmp_path / "snapshots"), expert_cache="48")
    reference = Engine(EngineConfig(**{**config.__dict__, "expert_cache": "all"}))
    reference.load()
    expected = [t for ids in reference.generate(list(PROMPT), SPEC, slot=0) for t in ids]
    reference.close()

    pipe = EnginePipe(DEFAULT_ENGINE_FACTORY, config)
    tokens: list[int] = []
    replies: dict[int, tuple[int, p.Event]] = {}  # command id -> (tokens seen then, reply)
    done: list[p.Done] = []

    def pump(until) -> None:
        while not until():
            event = pipe.recv()
            if isinstance(event, p.Tokens):
                tokens.extend(event.token_ids)
            elif isinstance(event, p.Done):
                done.append(event)
            else:
                assert not isinstance(event, p.Error), f"engine error: {event}"
                replies[event.command_id] = (len(tokens), event)

    try:
        pipe.conn.send(p.Envelope(1, p.Load(str(model_dir), 256, "cpu")))
        pump(lambda: 1 in replies)
        pipe.conn.send(p.Envelope(2, p.Generate("g", PROMPT, SPEC, slot=0)))
        pump(lambda: len(tokens) >= 4)
        pipe.conn.send(p.Envelope(3, p.ResizeExperts(1)))  # down to one layer's experts
        pump(lambda: 3 in replies)
        seen, shrunk = replies[3]
        pipe.conn.send(p.Envelope(4, p.ResizeExperts(48)))  # the game left: every slot back
        pump(lambda: 4 in replies)
        grown_at, grown = replies[4]
        pump(lambda: bool(done))
    finally:
        pipe.close()
    # Answered between tokens, while the stream was decoding, not after it drained.
    assert isinstance(shrunk, p.Reply) and isinstance(grown, p.Reply)
    assert 4 <= seen <= grown_at < NUM_TOKENS, (seen, grown_at)
    # (74 MiB of slots in one 128 MiB chunk: nothing to free here; test_expert_shrink.py
    # checks the bytes with small chunks.)
    assert shrunk.result["num_slots"] == NUM_EXPERTS
    assert grown.result["num_slots"] == 48 and grown.engine.experts["num_slots"] == 48
    assert tokens == expected and done[0].usage.completion_tokens == NUM_TOKENS
