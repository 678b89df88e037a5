"""The typed EngineStatus (protocol.py) through real engine processes: the real Engine on a tiny
MoE and the fake engine, side by side, answer GetStatus and every level command with the same
types, and the levels the host reads from them agree (STYLE #17: a fake is a contract)."""

from __future__ import annotations

import dataclasses

import pytest
from fakes.fake_engine import FAKE_ENGINE_FACTORY, FakeEngineConfig

from strata.engine import protocol as p
from strata.engine.core.process import DEFAULT_ENGINE_FACTORY
from strata.engine.service.levels import Level, levels_of
from tests.helpers.engine_pipe import EnginePipe
from tests.helpers.tiny_models import make_tiny_hf_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


class Pipe(EnginePipe):
    def generate(self, prompt: tuple[int, ...]) -> None:
        self.conn.send(p.Envelope(0, p.Generate("r", prompt, p.SamplingSpec(max_tokens=3))))
        while not isinstance(self.recv(), (p.Done, p.Error)):
            pass


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    from strata.engine.core.engine import EngineConfig

    model_dir, _ = make_tiny_hf_model("qwen3_moe", tmp_path_factory.mktemp("tiny"))
    snapshots = tmp_path_factory.mktemp("snapshots")
    real = Pipe(DEFAULT_ENGINE_FACTORY, EngineConfig(
        model_path=str(model_dir), device="cpu", context_tokens=256, snapshot_dir=str(snapshots)))
    fake = Pipe(FAKE_ENGINE_FACTORY, FakeEngineConfig(expert_bytes=32 << 20))
    yield {"real": real, "fake": fake}
    real.close()
    fake.close()


def field_types(value) -> dict[str, type]:
    """Each field's Python type, nested dataclasses (arenas, slots) by their own fields."""
    types: dict[str, type] = {}
    for f in dataclasses.fields(value):
        item = getattr(value, f.name)
        types[f.name] = type(item)
        if f.name == "arenas":
            for name, arena in item.items():
                types |= {f"arenas.{name}.{k}": type(v) for k, v in vars(arena).items()}
        elif f.name == "slots":
            types |= {f"slots.{k}": type(v) for k, v in vars(item[0]).items()}
    return types


def test_standby_status_is_typed(engines):
    for name, engine in engines.items():
        status = engine.ask(p.GetStatus())
        assert isinstance(status, p.Status), name
        assert status.engine.state is p.EngineState.STANDBY, name
        assert status.engine.pid == engine.process.pid and not status.engine.arenas, name
        assert status.engine.standby["is_cuda_initialized"] is False, name


def expert_keys(experts: dict | None) -> dict[str, str]:
    """The expert cache's counters (an untyped dict: /v1/status and the bench read its keys),
    by key: the value's type name, a number's as "number" (an int count may read 0.0 in a
    rate; a rate is None before its first figure), each layer row's keys as layers.KEY."""
    def kind(value) -> str:
        is_number = value is None or (isinstance(value, (int, float))
                                      and not isinstance(value, bool))
        return "number" if is_number else type(value).__name__
    if experts is None:
        return {}
    keys = {key: kind(value) for key, value in experts.items()}
    for row in experts.get("layers") or []:
        keys |= {f"layers.{key}": kind(value) for key, value in row.items()}
    return keys


def test_real_and_fake_report_the_same_types_at_every_level(engines):
    seen: dict[str, dict[str, dict[str, type]]] = {}
    for name, engine in engines.items():
        loaded = engine.ask(p.Load(engine.config.model_path, 256, "cpu"))
        assert isinstance(loaded, p.Reply) and loaded.engine is not None, name
        engine.generate((5, 6, 7, 8))
        status = engine.ask(p.GetStatus()).engine
        assert status.state is p.EngineState.LOADED and status.state == "loaded", name
        assert {"weights", "experts", "kv"} <= set(status.arenas), name
        assert levels_of(status).experts == Level.RESIDENT, name
        assert levels_of(status).session == Level.RESIDENT, name
        seen[name] = {"status": field_types(status), "experts": expert_keys(status.experts)}

        # A level command's reply carries the status after it: no second round trip.
        released = engine.ask(p.ReleaseExperts())
        assert isinstance(released, p.Reply) and released.engine is not None, name
        assert levels_of(released.engine).experts == Level.RELEASED, name
        assert released.engine.arenas["experts"].resident_bytes == 0, name
        refilled = engine.ask(p.RefillExperts()).engine
        assert levels_of(refilled).experts == Level.RESIDENT, name

        asleep = engine.ask(p.Sleep()).engine
        assert asleep.state is p.EngineState.SLEEPING, name
        assert levels_of(asleep).weights == Level.SLEEPING, name
        assert levels_of(asleep).session == Level.OFFLOADED, name
        assert asleep.resident_bytes() == 0, name
        seen[name]["asleep"] = field_types(asleep)
        assert engine.ask(p.Wake()).engine.state is p.EngineState.LOADED, name
    assert seen["real"] == seen["fake"]


def test_a_report_missing_a_field_is_refused():
    row = {"id": 0, "n_tokens": 3, "location": "cpu", "bytes": 96, "is_processing": False}
    with pytest.raises(TypeError, match="n_ctx"):
        p.EngineStatus.of_engine({"state": "loaded", "slots": [row]}, 1)
    with pytest.raises(TypeError, match="is_processing"):
        p.EngineStatus.of_engine({"slots": [{**row, "n_ctx": 8, "is_processing": 1}]}, 1)
    arena = {"state": "mapped", "reserved_bytes": 8, "resident_bytes": 8}
    with pytest.raises(TypeError, match="released_bytes"):
        p.EngineStatus.of_engine({"arenas": {"kv": arena}}, 1)
