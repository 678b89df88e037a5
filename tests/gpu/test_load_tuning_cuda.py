"""A load that has run before tunes nothing (issue 18 item 6): two fresh engine processes load
the same tiny model one after the other; the second reads the first's prefill timings from
the kernel cache (fast/tuning_store.py), so its breakdown shows no tuning and no probe
capture. No timings are asserted: only which phases ran."""

from __future__ import annotations

import pytest

from strata.engine.core.engine import EngineConfig
from strata.engine.core.fast.tuning_store import TuningStore
from strata.engine.core.load_phases import PHASE_NAMES
from strata.engine.protocol import Done, SamplingSpec, Tokens
from strata.engine.service.supervisor import Supervisor
from tests.helpers.tiny_models import make_tiny_hf_model

pytestmark = pytest.mark.gpu


async def load_in_a_fresh_process(config: EngineConfig) -> dict:
    """Spawn an engine process, load, answer one token, exit; the load's info."""
    supervisor = Supervisor(config, load_timeout_s=600)
    try:
        info = await supervisor.ensure_loaded()
        spec = SamplingSpec(max_tokens=2, temperature=0.0)
        events = [e async for e in supervisor.stream("t", list(range(5, 40)), spec)]
        assert isinstance(events[-1], Done) and any(isinstance(e, Tokens) for e in events)
        return info
    finally:
        await supervisor.stop()
        await supervisor.stop_standby()


@pytest.mark.timeout(600)
async def test_a_second_load_in_a_fresh_process_tunes_nothing(tmp_path) -> None:
    model_dir, _ = make_tiny_hf_model("llama", tmp_path)
    config = EngineConfig(model_path=str(model_dir), device="cuda", context_tokens=512,
                          snapshot_dir=str(tmp_path / "snapshots"))
    first = await load_in_a_fresh_process(config)
    second = await load_in_a_fresh_process(config)
    # The first may already find a result (this machine loaded this shape before); the
    # second always must.
    assert first["tuning"] in ("measured", "stored"), first
    assert second["tuning"] == "stored", second
    phases = second["load_phases_s"]
    assert set(phases) == {f"{name}_s" for name in PHASE_NAMES} | {"other_s"}
    assert phases["tune_s"] == 0.0 and phases["capture_graphs_s"] == 0.0, phases
    assert phases["cuda_init_s"] > 0 and phases["map_weights_s"] > 0, phases
    # Where the engine processes keep it (they share this process's environment).
    assert list(TuningStore().directory.glob("prefill-*.json"))
