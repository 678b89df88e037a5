"""A load's seconds per phase (load_phases.py): phases nest exclusively, a phase outside a
load records nothing, and a CPU engine load reports every phase (issue 18 item 6)."""

from __future__ import annotations

import pytest

from strata.engine.core import load_phases
from strata.engine.core.load_phases import PHASE_NAMES, LoadPhases


class FakeClock:
    """perf_counter for load_phases: advances only when a test says so."""

    def __init__(self):
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += seconds


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(load_phases.time, "perf_counter", fake)
    return fake


def test_a_nested_phase_takes_its_seconds_out_of_the_outer_one(clock) -> None:
    phases = LoadPhases()
    with phases.phase("map_weights"):
        clock.advance(2)
        with phases.phase("build_model"):
            clock.advance(5)
            with phases.phase("warm_up"):
                clock.advance(7)
        clock.advance(3)
    assert phases.seconds["map_weights"] == 5  # only its own 2 + 3
    assert phases.seconds["build_model"] == 5 and phases.seconds["warm_up"] == 7


def test_phases_add_up_and_the_breakdown_names_every_phase_with_its_unit(clock) -> None:
    phases = LoadPhases()
    for _ in range(2):
        with phases.phase("tune"):
            clock.advance(0.25)
    breakdown = phases.breakdown_s()
    assert list(breakdown) == [f"{name}_s" for name in PHASE_NAMES]
    assert breakdown["tune_s"] == 0.5 and breakdown["compile_s"] == 0.0
    assert phases.summary() == "tune 0.50 s"


def test_a_phase_that_raises_still_counts(clock) -> None:
    phases = LoadPhases()
    with pytest.raises(RuntimeError), phases.phase("read_file"):
        clock.advance(1)
        raise RuntimeError("bad file")
    assert phases.seconds["read_file"] == 1


def test_an_unknown_phase_is_an_error() -> None:
    with pytest.raises(ValueError, match="unknown load phase 'typo'"), LoadPhases().phase("typo"):
        pass


def test_outside_a_load_a_phase_records_nothing(clock) -> None:
    with load_phases.phase("tune"):  # a bench or a test calling part of a load alone
        clock.advance(1)
    phases = LoadPhases()
    with load_phases.recording(phases), load_phases.phase("tune"):
        clock.advance(2)
    with load_phases.phase("tune"):
        clock.advance(4)
    assert phases.seconds["tune"] == 2


def test_a_cpu_engine_load_reports_its_phases(tmp_path) -> None:
    from strata.engine.core.engine import Engine, EngineConfig
    from tests.helpers.tiny_models import make_tiny_hf_model

    path, _ = make_tiny_hf_model("llama", tmp_path)
    engine = Engine(EngineConfig(model_path=str(path), device="cpu",
                                 snapshot_dir=str(tmp_path / "snapshots")))
    info = engine.load()
    try:
        phases = info["load_phases_s"]
        assert set(phases) == {f"{name}_s" for name in PHASE_NAMES} | {"other_s"}
        assert phases["map_weights_s"] > 0  # the rest of a tiny model's may round to 0 ms
        assert min(phases.values()) >= 0
        # The CPU has no fast decoder: nothing compiled, tuned or captured.
        assert phases["compile_s"] == phases["tune_s"] == phases["capture_graphs_s"] == 0.0
        assert info["tuning"] == "none"
        assert sum(phases.values()) == pytest.approx(info["load_time_s"], abs=0.01)
        assert engine.status()["load_phases_s"] == phases  # /v1/status carries it too
    finally:
        engine.close()


def test_a_cpu_standby_warms_what_a_cpu_load_imports() -> None:
    """The model files' attention imports torch._dynamo (seconds): a CPU standby imports
    the loaders and models ahead, and nothing for the GPU (no compiler keys, no kernels)."""
    import sys

    from strata.engine.core.engine import Engine, EngineConfig

    names = Engine.warm_imports(EngineConfig(model_path="unused", device="cpu"))
    assert "strata.engine.core.models.llama" in names
    assert "strata.engine.core.loader.gguf" in names
    assert all(name in sys.modules for name in names)
    assert not any(name.startswith("strata.engine.core.fast") for name in names)
    assert "torch_key" not in names


def test_a_stopped_warm_up_imports_no_further_module() -> None:
    """A load stops the standby's imports (process.py: two threads importing one graph can
    meet half-run modules): with the stop already set, the warm-up returns before its first
    import, and set after its first module, it names only that one."""
    import threading

    from strata.engine.core.engine import Engine, EngineConfig

    config = EngineConfig(model_path="unused", device="cpu")
    stop = threading.Event()
    stop.set()
    assert Engine.warm_imports(config, stop) == []

    class StopAfterFirst(threading.Event):  # set from its fourth read: two reads before
        reads = 0                                # the CPU's two packages, one before a module

        def is_set(self) -> bool:
            self.reads += 1
            return self.reads > 3

    names = Engine.warm_imports(config, StopAfterFirst())
    assert names and all(name.startswith("strata.engine.core.loader.") for name in names), names
