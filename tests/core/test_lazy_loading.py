"""Loading through FileWeights.open: tensors read one at a time from the mapped file, in the
file's dtype, straight into the arena views ModelMemory lays out (the engine's load path)."""

from __future__ import annotations

import weakref

import pytest
import torch
from safetensors.torch import load_file

from strata.engine.core.loader import load_model_config, load_tensors, open_tensors
from strata.engine.core.loader.hf import load_hf_config
from strata.engine.core.loader.lazy import DeferredTensor, StackedTensor, in_memory
from strata.engine.core.memory.backend import backend_for
from strata.engine.core.residency import ModelMemory
from strata.engine.core.weight_source import FileWeights
from tests.core.test_gguf_loader import hf_canonical
from tests.helpers.tiny_models import VARIANTS, make_tiny_hf_model

MOE_VARIANTS = ("qwen3_moe", "qwen3_moe_mixed", "mixtral")


def build_in_arenas(directory, dtype: torch.dtype, expert_cache: str = "all"):
    """(memory, model) built the way Engine.load does, from the lazy source."""
    config = load_hf_config(directory)
    memory = ModelMemory(backend_for("cpu"), dtype)
    model = memory.build(config, FileWeights.open(directory, config), expert_cache)
    return memory, model


def assert_parameters_equal(model, expected: dict[str, torch.Tensor]) -> None:
    params = dict(model.named_parameters())
    assert sorted(params) == sorted(expected)
    for name, want in expected.items():
        assert params[name].dtype == want.dtype, name
        assert torch.equal(params[name], want), name


# Architectures whose sanitize() changes transformers' tensors on purpose (Phi's fused qkv and
# gate_up split, partial RoPE's q/k row order, gpt-oss's interleaved gate_up): their loads are
# checked by logits against transformers (test_models_parity.py), not parameter by parameter.
RESHAPED = {"phi3", "phi3_partial_longrope", "glm4_moe", "gpt_oss"}


@pytest.mark.parametrize(
    ("variant", "expert_cache"),
    [(v, "all") for v in VARIANTS if v not in RESHAPED]
    + [(v, "off") for v in MOE_VARIANTS if v not in RESHAPED],
)
def test_lazy_load_equals_transformers_parameters(variant, expert_cache, tmp_path):
    directory, hf_model = make_tiny_hf_model(variant, tmp_path)
    memory, model = build_in_arenas(directory, torch.float32, expert_cache)
    try:
        assert_parameters_equal(model, hf_canonical(hf_model))
    finally:
        memory.close()


@pytest.mark.parametrize("variant", ["llama", "mixtral"])
def test_load_tensors_is_the_lazy_source_read_into_float32(variant, tmp_path):
    _, hf_model = make_tiny_hf_model(variant, tmp_path)
    hf_model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    config = load_hf_config(tmp_path / "bf16")
    lazy = open_tensors(tmp_path / "bf16", config)
    assert {t.dtype for t in lazy.values()} == {torch.bfloat16}  # the file's dtype, not widened
    eager = load_tensors(tmp_path / "bf16", config)
    assert eager.keys() == lazy.keys()
    for name, tensor in eager.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, lazy[name].read().float()), name


def test_bf16_checkpoint_into_a_bf16_arena_is_bit_identical(tmp_path):
    _, hf_model = make_tiny_hf_model("qwen2", tmp_path)
    hf_model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    on_disk = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    assert {t.dtype for t in on_disk.values()} == {torch.bfloat16}
    memory, model = build_in_arenas(tmp_path / "bf16", torch.bfloat16)
    try:
        assert_parameters_equal(model, on_disk)
    finally:
        memory.close()


def test_bf16_moe_checkpoint_into_a_bf16_arena_is_bit_identical(tmp_path):
    _, hf_model = make_tiny_hf_model("qwen3_moe", tmp_path)
    hf_model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    memory, model = build_in_arenas(tmp_path / "bf16", torch.bfloat16)
    try:
        assert_parameters_equal(model, hf_canonical(hf_model))
    finally:
        memory.close()


class ReadTracker:
    """Wraps DeferredTensor.read: records every tensor handed out and, at each read, how many
    of the earlier ones are still alive (CPython frees them on the last reference: exact)."""

    def __init__(self, monkeypatch):
        self.alive: list[weakref.ref] = []
        self.dtypes: set[torch.dtype] = set()
        self.max_alive = 0
        original = DeferredTensor.read

        def read(lazy):
            self.alive = [ref for ref in self.alive if ref() is not None]
            self.max_alive = max(self.max_alive, len(self.alive))
            tensor = original(lazy)
            self.dtypes.add(tensor.dtype)
            self.alive.append(weakref.ref(tensor))
            return tensor

        monkeypatch.setattr(DeferredTensor, "read", read)


@pytest.mark.parametrize("variant", ["llama", "qwen3_moe"])
def test_source_holds_one_tensor_at_a_time_in_the_file_dtype(variant, tmp_path, monkeypatch):
    _, hf_model = make_tiny_hf_model(variant, tmp_path)
    hf_model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    tracker = ReadTracker(monkeypatch)
    memory, _ = build_in_arenas(tmp_path / "bf16", torch.float32)
    try:
        assert tracker.alive, "nothing was read through the lazy source"
        assert tracker.max_alive == 0  # each tensor was dropped before the next was read
        assert tracker.dtypes == {torch.bfloat16}  # never widened to float32 on the way
    finally:
        memory.close()


@pytest.mark.parametrize("expert_cache", ["all", "8"])
def test_every_tensor_is_read_from_the_file_once(expert_cache, tmp_path, monkeypatch):
    """Experts included: the store checks their shapes from the headers, then each handle
    copies itself into the host copy (no second read, no stacked intermediate)."""
    directory, _ = make_tiny_hf_model("qwen3_moe", tmp_path)
    reads: list[tuple[int, ...]] = []
    original = DeferredTensor.read
    monkeypatch.setattr(DeferredTensor, "read",
                        lambda lazy: reads.append(id(lazy)) or original(lazy))
    memory, _ = build_in_arenas(directory, torch.float32, expert_cache)
    try:
        assert reads and len(reads) == len(set(reads))
    finally:
        memory.close()


def test_check_runs_on_headers_before_any_read(tmp_path, monkeypatch):
    directory, _ = make_tiny_hf_model("llama", tmp_path)
    config = load_hf_config(directory)
    source = FileWeights.open(directory, config)
    tracker = ReadTracker(monkeypatch)
    with pytest.raises(Exception, match=r"missing tensor model.extra.weight"):
        source.check({"model.extra.weight": (1,)})
    assert not tracker.alive


def test_stacked_tensor_copies_each_part_into_its_row():
    parts = [torch.full((2, 3), float(e), dtype=torch.bfloat16) for e in range(4)]
    stacked = StackedTensor([in_memory(p) for p in parts])
    assert stacked.shape == (4, 2, 3) and stacked.dtype == torch.bfloat16
    out = torch.empty(stacked.shape, dtype=torch.float32)
    stacked.copy_to(out)
    assert torch.equal(out, torch.stack(parts).float())
    assert torch.equal(stacked.read(), torch.stack(parts))


@pytest.mark.parametrize(
    ("variant", "qtype", "per_expert"),
    [("llama", "F16", False), ("mixtral", "Q8_0", True), ("qwen3_moe_mixed", "F32", False)],
)
def test_gguf_goes_through_the_same_lazy_path(variant, qtype, per_expert, tmp_path):
    from tests.core.test_gguf_loader import hf_model
    from tests.helpers.gguf_writer import write_gguf_from_hf

    path = write_gguf_from_hf(
        hf_model(variant), None, tmp_path / "m.gguf", qtype, per_expert_tensors=per_expert
    )
    config = load_model_config(path)
    lazy = open_tensors(path, config)
    # F32/F16 are read in their own dtype from the mapped file; quantized types as float32.
    want_dtype = {"F16": torch.float16, "F32": torch.float32, "Q8_0": torch.float32}[qtype]
    assert lazy["model.layers.0.self_attn.q_proj.weight"].dtype == want_dtype
    memory = ModelMemory(backend_for("cpu"), torch.float32)
    try:
        model = memory.build(config, FileWeights.open(path, config), "all")
        assert_parameters_equal(model, load_tensors(path, config))
    finally:
        memory.close()
