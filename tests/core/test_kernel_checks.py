"""The decode kernels' verdicts kept with the tuning (fast/kernel_checks.py, issue 18 item 6):
a first decoder checks and stores them, a later one with the same key reads them without
checking, a change in the key (here the kernels' source) checks again, and a decoder that
read them checks again after the load, turning off a kernel that fails now."""

from __future__ import annotations

import pytest
import torch

from strata.engine.core.fast import GraphDecoder, kernel_checks
from strata.engine.core.fast.pointwise import EAGER_OPS
from strata.engine.core.fast.tuning_store import TuningStore
from strata.engine.core.model_config import ModelConfig
from strata.engine.core.random_weights import build_random_model

CONFIG = ModelConfig(model_type="llama", vocab_size=96, hidden_size=64, intermediate_size=80,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=16, max_position_embeddings=512)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model():
    return build_random_model(CONFIG, "cpu", torch.float32, seed=3, std=0.15)


def decode_kernels(model, store):
    return kernel_checks.decode_kernels(model, CPU, EAGER_OPS, fused_attention=True,
                                        dense_kernels=True, store=store)


def test_verdicts_are_checked_once_then_read(model, tmp_path, monkeypatch) -> None:
    store = TuningStore(tmp_path)
    ops, notes, source = decode_kernels(model, store)
    assert source == "checked"
    assert len(list(tmp_path.glob("kernels-*.json"))) == 1

    def no_check(*args, **kwargs):
        raise AssertionError("stored verdicts must not be checked again at load")

    monkeypatch.setattr(kernel_checks, "check", no_check)
    again, again_notes, again_source = decode_kernels(model, store)
    assert again_source == "stored"
    assert (again.fused_attention, again.dense_kernels) == (ops.fused_attention,
                                                            ops.dense_kernels)
    assert again_notes == notes


def test_a_changed_kernel_source_checks_again(model, tmp_path, monkeypatch) -> None:
    store = TuningStore(tmp_path)
    assert decode_kernels(model, store)[2] == "checked"
    monkeypatch.setattr(kernel_checks, "kernel_source_digest", lambda: "edited")
    assert decode_kernels(model, store)[2] == "checked"
    assert len(list(tmp_path.glob("kernels-*.json"))) == 2


def test_a_stored_pass_that_fails_now_is_turned_off_after_the_load(model, tmp_path,
                                                                  monkeypatch) -> None:
    monkeypatch.setattr(kernel_checks.pdl, "is_supported", lambda device: False)
    # The check finds the fused attention wrong now (whether Triton runs interpreted in this
    # process depends on the tests before): as if the GPU changed behaviour without its key
    # changing.
    monkeypatch.setattr(kernel_checks, "check_fused",
                        lambda attn, dtype, device: "differs from torch")
    store = TuningStore(tmp_path)
    key = kernel_checks.verdicts_key(model, CPU, fused_attention=True, dense_kernels=False,
                                     use_pdl=False)
    store.write(key, kernel_checks.Verdicts("", None, False).as_json())
    decoder = GraphDecoder(model, use_cuda_graphs=False, compile_pointwise=False,
                           fused_attention=True, dense_kernels=False, store=store)
    assert decoder.kernel_check == "stored" and decoder.ops.fused_attention
    assert decoder.has_deferred_work
    assert decoder.run_deferred_step() == "check decode kernels"
    assert not decoder.ops.fused_attention and "torch attention" in decoder.note
    assert not decoder.has_deferred_work
    assert kernel_checks.read_stored(store, key).attention  # the failing verdict, stored
