"""Tuning results on disk (fast/tuning_store.py): a round trip, keys that change with the GPU,
the software and the model's content (never its path), corrupt or foreign files ignored with
one log line, and writes that are atomic (issue 18 item 6)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os

import pytest
import torch

from strata.engine.core.fast import tuning_store
from strata.engine.core.fast.tuning_store import (
    TuningKey,
    TuningStore,
    device_identity,
    model_identity,
)
from strata.engine.core.model_config import ModelConfig
from strata.engine.core.random_weights import build_random_model

CONFIG = ModelConfig(model_type="llama", vocab_size=96, hidden_size=64, intermediate_size=80,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=16, max_position_embeddings=512)
H200 = {"type": "cuda", "name": "NVIDIA H200", "capability": [9, 0], "driver": "570.86.15",
        "cuda": "12.8", "torch": "2.13.0", "triton": "3.9.0"}
SETTINGS = {"chunk_tokens": 512, "moe_impl": "loop", "is_compiled": True,
            "is_capturable": True, "use_cuda_graphs": True, "has_moe_block": False}
RESULT = {"ops_s": {"compiled": 0.004, "eager": 0.003},
          "graphs": {"chunk_replay_s": 0.001, "host_s": 0.002, "graph_tokens": 512}}


def model_key(config: ModelConfig = CONFIG, dtype: torch.dtype = torch.float32,
              seed: int = 0) -> dict:
    return model_identity(build_random_model(config, "cpu", dtype, seed=seed))


def key(device: dict | None = None, model: dict | None = None,
        settings: dict | None = None) -> TuningKey:
    return TuningKey(device or H200, model or model_key(), settings or SETTINGS)


def test_a_written_result_reads_back(tmp_path) -> None:
    store = TuningStore(tmp_path / "tuning")
    assert store.read(key()) is None  # nothing stored: no file, no error
    path = store.write(key(), RESULT)
    assert path is not None and path.parent == tmp_path / "tuning"
    assert store.read(key()) == RESULT
    assert TuningStore(tmp_path / "tuning").read(key()) == RESULT  # another process's store


@pytest.mark.parametrize("field, value", [
    ("name", "NVIDIA H100 80GB HBM3"), ("capability", [8, 9]), ("driver", "575.51.03"),
    ("cuda", "12.9"), ("torch", "2.14.0"), ("triton", "3.10.0"),
])
def test_the_key_changes_with_the_gpu_and_the_software(field, value, tmp_path) -> None:
    store = TuningStore(tmp_path)
    store.write(key(), RESULT)
    other = key(device={**H200, field: value})
    assert other.digest != key().digest
    assert store.read(other) is None


def test_the_key_follows_the_models_shapes_and_dtype_not_its_weights() -> None:
    base = model_key()
    assert model_key(seed=3) == base  # other weights, same shapes: the same timings
    assert model_key(dataclasses.replace(CONFIG, intermediate_size=96)) != base
    assert model_key(dataclasses.replace(CONFIG, num_hidden_layers=3)) != base
    assert model_key(dtype=torch.bfloat16) != base
    assert key(settings={**SETTINGS, "chunk_tokens": 256}).digest != key().digest


def test_the_key_names_each_quantized_weights_type() -> None:
    from gguf import GGMLQuantizationType

    class Weight:  # what QuantizedLinear holds: a GGML type and a logical shape
        def __init__(self, qtype):
            self.qtype, self.shape = qtype, (32, 64)

    def quantized(qtype) -> dict:
        model = build_random_model(CONFIG, "cpu", torch.float32, seed=0)
        model.model.layers[0].mlp.gate_proj.packed = Weight(qtype)
        return model_identity(model)

    assert quantized(GGMLQuantizationType.Q4_K) != quantized(GGMLQuantizationType.Q8_0)
    assert quantized(GGMLQuantizationType.Q4_K) == quantized(GGMLQuantizationType.Q4_K)
    assert quantized(GGMLQuantizationType.Q4_K) != model_key()


def test_the_device_key_on_the_cpu_names_the_software() -> None:
    identity = device_identity(torch.device("cpu"))
    assert identity["type"] == "cpu" and identity["torch"] == torch.__version__
    assert "triton" in identity
    json.dumps(identity)  # plain JSON values only


@pytest.mark.parametrize("text", [
    "{not json", "[]", json.dumps({"schema": 999, "key": {}, "result": {}}),
    "",
])
def test_a_corrupt_file_is_ignored_with_one_log_line(text, tmp_path, caplog) -> None:
    store = TuningStore(tmp_path)
    store.path_for(key()).write_text(text)
    with caplog.at_level(logging.INFO, logger=tuning_store.__name__):
        assert store.read(key()) is None
    assert len(caplog.records) == 1 and "tuning again" in caplog.records[0].getMessage()
    store.write(key(), RESULT)  # the next load's result replaces it
    assert store.read(key()) == RESULT


def test_a_file_of_another_key_under_this_name_is_ignored(tmp_path, caplog) -> None:
    store = TuningStore(tmp_path)
    other = key(device={**H200, "driver": "1.0"})
    store.write(other, RESULT)
    os.replace(store.path_for(other), store.path_for(key()))  # a collision, or a copied file
    with caplog.at_level(logging.INFO, logger=tuning_store.__name__):
        assert store.read(key()) is None
    assert "another GPU, model or version" in caplog.text


def test_a_record_without_a_result_object_is_ignored(tmp_path) -> None:
    store = TuningStore(tmp_path)
    record = {"schema": tuning_store.SCHEMA_VERSION, "key": key().as_json(), "result": [1]}
    store.path_for(key()).write_text(json.dumps(record))
    assert store.read(key()) is None


def test_a_failed_write_leaves_the_old_file_whole_and_no_temp_file(tmp_path, monkeypatch,
                                                                   caplog) -> None:
    store = TuningStore(tmp_path)
    store.write(key(), RESULT)
    before = store.path_for(key()).read_bytes()

    def no_rename(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tuning_store.os, "replace", no_rename)
    with caplog.at_level(logging.INFO, logger=tuning_store.__name__):
        assert store.write(key(), {"ops_s": {}, "graphs": {}}) is None
    assert "the next load tunes again" in caplog.text
    assert store.path_for(key()).read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [store.path_for(key()).name]


def test_a_write_leaves_only_the_result_file(tmp_path) -> None:
    store = TuningStore(tmp_path / "a" / "b")  # created on the first write
    store.write(key(), RESULT)
    store.write(key(settings={**SETTINGS, "moe_impl": "grouped"}), RESULT)
    names = sorted(p.name for p in (tmp_path / "a" / "b").iterdir())
    assert len(names) == 2 and all(n.startswith("prefill-") and n.endswith(".json")
                                   for n in names)


def test_an_unwritable_directory_costs_only_a_log_line(tmp_path, caplog) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    store = TuningStore(blocker / "tuning")  # a directory under a file cannot exist
    with caplog.at_level(logging.INFO, logger=tuning_store.__name__):
        assert store.write(key(), RESULT) is None
    assert store.read(key()) is None
    assert "not stored" in caplog.text


def test_the_default_directory_is_under_the_kernel_cache(monkeypatch, tmp_path) -> None:
    from strata import paths

    monkeypatch.setattr(paths, "kernel_cache_dir", lambda: tmp_path / "kernels")
    assert TuningStore().directory == tmp_path / "kernels" / "tuning"
