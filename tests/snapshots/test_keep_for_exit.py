"""A rule's unload keeps the conversations: Engine.close_for_exit(keep_sessions_as) writes every
slot's history to a file after the arenas are closed (on a GPU: after the context is gone), and
a new engine restores them with the same greedy output."""

from __future__ import annotations

import pytest

from tests.core.engine_memory_helpers import make_engine, run
from tests.helpers.tiny_models import make_tiny_hf_model

KEPT = "kept-slot{slot}.snap"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path, _ = make_tiny_hf_model("llama", tmp_path_factory.mktemp("tiny"))
    return path


def test_close_for_exit_keeps_every_slot_with_a_history(model_dir, tmp_path) -> None:
    engine = make_engine(model_dir, tmp_path)
    first, third = list(range(3, 40)), list(range(50, 70))
    out_first, out_third = run(engine, first, slot=0), run(engine, third, slot=2)
    engine.offload_session()  # slot 2 in RAM, slot 0 too: both must be kept
    out_second = run(engine, first + out_first + [7], slot=1)
    kept = engine.close_for_exit(keep_sessions_as=KEPT)
    assert kept == [0, 1, 2]
    assert sorted(p.name for p in tmp_path.glob("kept-slot*.snap")) == [
        "kept-slot0.snap", "kept-slot1.snap", "kept-slot2.snap"]

    again = make_engine(model_dir, tmp_path)
    try:
        for slot in kept:
            again.restore_slot(slot, KEPT.format(slot=slot))
        follow_up = first + out_first + [9, 10]
        assert run(again, follow_up, slot=0) == run(make_engine(model_dir, tmp_path), follow_up)
        assert again.last_usage.cached_tokens == len(first) + len(out_first) - 1
        run(again, third + out_third + [5], slot=2)
        assert again.last_usage.cached_tokens >= len(third)
        run(again, first + out_first + [7] + out_second, slot=1)
        assert again.last_usage.cached_tokens >= len(first)
    finally:
        again.close()


def test_close_for_exit_without_keep_writes_nothing(model_dir, tmp_path) -> None:
    engine = make_engine(model_dir, tmp_path)
    run(engine, list(range(3, 30)))
    assert engine.close_for_exit() == []
    assert not list(tmp_path.glob("*.snap"))
