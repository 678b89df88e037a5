"""A load that has run before compiles and checks nothing on its critical path (issue 18 item
6), through real engine processes on the CPU (the fast decoder forced on with
fast_compile_pointwise, which compiles with Inductor's C++ backend here):

- the second process's load reads the first's timings, reports compile "deferred" and 0 s of
  compile, answers a request before compiling (greedy tokens equal to the first process's,
  which compiled at load), then compiles once idle and answers the same again;
- a Load that reaches a standby still warming its imports starts at once.
"""

from __future__ import annotations

import time

import pytest

from strata.engine import protocol as p
from strata.engine.core.engine_config import EngineConfig
from strata.engine.core.process import DEFAULT_ENGINE_FACTORY, DEFERRED_WORK_IDLE_S
from tests.helpers.engine_pipe import EnginePipe
from tests.helpers.gated_warm_engine import FACTORY as GATED_FACTORY
from tests.helpers.gated_warm_engine import GATE_ENV
from tests.helpers.tiny_models import make_tiny_hf_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROMPT = tuple((7 * i + 3) % 97 for i in range(30))
GREEDY = p.SamplingSpec(max_tokens=6, temperature=0.0)


class Pipe(EnginePipe):
    def __init__(self, factory: str, config) -> None:
        super().__init__(factory, config, timeout_s=300.0)  # a load compiles on the CPU

    def tokens(self, prompt: tuple[int, ...]) -> list[int]:
        self.conn.send(p.Envelope(0, p.Generate("r", prompt, GREEDY, slot=None)))
        tokens: list[int] = []
        while True:
            event = self.recv()
            if isinstance(event, p.Tokens):
                tokens += event.token_ids
            elif isinstance(event, p.Error):
                raise AssertionError(event)
            elif isinstance(event, p.Done):
                return tokens


@pytest.fixture
def config(tmp_path, monkeypatch) -> EngineConfig:
    # The engine processes keep their tuning results under this machine's cache: a fresh one.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    model_dir, _ = make_tiny_hf_model("llama", tmp_path)
    return EngineConfig(model_path=str(model_dir), device="cpu", context_tokens=256,
                        snapshot_dir=str(tmp_path / "snapshots"), num_slots=1,
                        fast_compile_pointwise=True)


def load(engine: Pipe) -> dict:
    reply = engine.ask(p.Load(engine.config.model_path, 256, "cpu"))
    assert isinstance(reply, p.Reply), reply
    return reply.result


def wait_for_deferred_work(engine: Pipe, timeout_s: float = 300.0) -> dict:
    """The engine's model info once its deferred load work has ended. Asked more often
    than the loop's idle wait (process.DEFERRED_WORK_IDLE_S), as a status-polling client
    does: status reads must not hold the work off."""
    deadline_s = time.monotonic() + timeout_s
    while time.monotonic() < deadline_s:
        model = engine.ask(p.GetStatus()).engine.model
        if model["compile_state"] != "pending":
            return model
        time.sleep(DEFERRED_WORK_IDLE_S / 3)
    raise AssertionError("the deferred load work never ended")


def test_a_second_load_compiles_after_it_is_ready_with_the_same_tokens(config) -> None:
    first = Pipe(DEFAULT_ENGINE_FACTORY, config)
    try:
        measured = load(first)
        assert measured["tuning"] == "measured" and measured["compile"] == "at_load", measured
        assert measured["load_phases_s"]["compile_s"] > 0
        compiled_tokens = first.tokens(PROMPT)
    finally:
        first.close()

    second = Pipe(DEFAULT_ENGINE_FACTORY, config)
    try:
        stored = load(second)
        assert stored["tuning"] == "stored" and stored["compile"] == "deferred", stored
        phases = stored["load_phases_s"]
        assert phases["compile_s"] == phases["tune_s"] == phases["check_kernels_s"] == 0.0
        # Sent at once, this request runs before any compile (eager groups): same tokens.
        assert second.tokens(PROMPT) == compiled_tokens
        done = wait_for_deferred_work(second)
        assert done["compile_state"] == "done", done
        assert second.tokens(PROMPT[:20]) == second.tokens(PROMPT[:20])  # cached prefix too
        assert second.tokens(PROMPT) == compiled_tokens
    finally:
        second.close()


def test_a_load_stops_a_standby_still_warming_and_imports_alone(config, tmp_path,
                                                                monkeypatch) -> None:
    """The warm-up waits for a gate that opens only after the load: the load neither waits
    for it to finish nor runs beside it (the thread has stopped), and then answers."""
    gate = tmp_path / "warm-gate"
    monkeypatch.setenv(GATE_ENV, str(gate))
    engine = Pipe(GATED_FACTORY, config)
    try:
        standby = engine.ask(p.GetStatus()).engine.standby
        assert standby["is_factory_imported"] and not standby["is_warm"], standby
        info = load(engine)
        assert info["was_warm_at_load"] is False
        assert info["was_warming_at_load"] is False
        assert engine.tokens(PROMPT)
    finally:
        gate.touch()
        engine.close()
