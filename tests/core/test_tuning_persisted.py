"""A load's prefill tuning through a TuningStore (fast/tuning.py's tune_prefill), on the CPU
with torch.compile's groups: the first decoder measures and stores, a fresh one over the same
model decides from the file without a single timing run, and a stored result of the wrong
shape is measured again (issue 18 item 6)."""

from __future__ import annotations

import json

import pytest
import torch

from strata.engine.core import load_phases
from strata.engine.core.fast import GraphDecoder, tuning
from strata.engine.core.fast.tuning_store import TuningStore
from strata.engine.core.kv_cache import KVCache
from strata.engine.core.model_config import ModelConfig
from strata.engine.core.random_weights import build_random_model

CONFIG = ModelConfig(model_type="llama", vocab_size=96, hidden_size=64, intermediate_size=80,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=16, max_position_embeddings=512)


def decoder_for(model, compiled: bool = True) -> GraphDecoder:
    # Chunks of 24: no chunk length equals a model dimension (tuning.warm_up_prefill).
    return GraphDecoder(model, use_cuda_graphs=False, compile_pointwise=compiled,
                        fused_attention=False, dense_kernels=False, prefill_chunk_tokens=24)


def no_timing(*args, **kwargs):
    raise AssertionError("a stored result must not time anything")


@pytest.fixture(scope="module")
def model():
    return build_random_model(CONFIG, "cpu", torch.float32, seed=7, std=0.15)


def test_a_fresh_decoder_reuses_the_stored_timings(model, tmp_path, monkeypatch) -> None:
    store = TuningStore(tmp_path)
    first = decoder_for(model)
    measured_phases = load_phases.LoadPhases()
    with load_phases.recording(measured_phases):
        measured = first.tune_prefill(store=store)
    assert measured["source"] == "measured" and set(measured["ops_s"]) == {"compiled", "eager"}
    assert measured_phases.seconds["tune"] > 0 and measured_phases.seconds["compile"] > 0
    assert len(list(tmp_path.glob("prefill-*.json"))) == 1

    monkeypatch.setattr(tuning, "_best_s", no_timing)
    # Another model object of the same shapes (a new engine process builds its own).
    again = build_random_model(CONFIG, "cpu", torch.float32, seed=8, std=0.15)
    second = decoder_for(again)
    stored_phases = load_phases.LoadPhases()
    with load_phases.recording(stored_phases):
        stored = second.tune_prefill(store=store)
    assert stored["source"] == "stored"
    assert stored["ops_s"] == pytest.approx(measured["ops_s"])
    assert second.prefill_ops.is_compiled == first.prefill_ops.is_compiled
    assert stored_phases.seconds["tune"] == 0.0
    assert stored_phases.seconds["capture_graphs"] == 0.0

    # Whatever it chose, the prefill is the eager decoder's.
    eager = decoder_for(again, compiled=False)
    ids = torch.arange(43) * 5 % 96
    kv_a, kv_b = (KVCache.for_config(again.config, 96) for _ in range(2))
    torch.testing.assert_close(second.prefill(kv_a, ids, 0), eager.prefill(kv_b, ids, 0),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("compiled_s, eager_s, is_compiled", [(0.010, 0.002, False),
                                                              (0.002, 0.010, True)])
def test_the_stored_timings_decide_as_a_measurement_would(model, tmp_path, monkeypatch,
                                                          compiled_s, eager_s,
                                                          is_compiled) -> None:
    store = TuningStore(tmp_path)
    decoder = decoder_for(model)
    key = tuning.tuning_key(decoder.prefiller, use_cuda_graphs=False)
    store.write(key, {"ops_s": {"compiled": compiled_s, "eager": eager_s}, "graphs": {}})
    monkeypatch.setattr(tuning, "_best_s", no_timing)
    found = decoder.tune_prefill(store=store)
    assert found["source"] == "stored"
    assert decoder.prefill_ops.is_compiled == is_compiled


@pytest.mark.parametrize("result", [
    {"graphs": {}},  # no op timings for compiled groups
    {"ops_s": {"compiled": "fast", "eager": 0.1}, "graphs": {}},
    {"ops_s": {"compiled": 0.1, "eager": 0.1}, "graphs": {"host_s": 0.1, "chunk_replay_s": 0.1}},
])
def test_a_stored_result_of_the_wrong_shape_is_measured_again(model, tmp_path,
                                                              result) -> None:
    store = TuningStore(tmp_path)
    decoder = decoder_for(model)
    key = tuning.tuning_key(decoder.prefiller, use_cuda_graphs=False)
    store.write(key, result)
    found = decoder.tune_prefill(store=store)
    assert found["source"] == "measured"
    record = json.loads(store.path_for(key).read_text())
    assert set(record["result"]["ops_s"]) == {"compiled", "eager"}  # overwritten


def test_nothing_to_tune_writes_nothing(model, tmp_path) -> None:
    store = TuningStore(tmp_path)
    found = decoder_for(model, compiled=False).tune_prefill(store=store)
    assert found == {"warm_up_s": 0.0, "ops_s": {}, "graphs": {}, "source": "none",
                     "compile": "none"}
    assert not tmp_path.exists() or not list(tmp_path.iterdir())


def test_without_a_store_every_load_measures(model) -> None:
    decoder = decoder_for(model)
    assert decoder.tune_prefill()["source"] == "measured"
    assert decoder_for(model).tune_prefill()["source"] == "measured"
