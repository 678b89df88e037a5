"""loader/hf.py and build_model: config reading, layouts on disk, and every error message."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from strata.engine.core.kv_cache import KVCache
from strata.engine.core.loader.hf import load_hf_config, load_hf_tensors
from strata.engine.core.model_config import ModelFormatError
from strata.engine.core.models.build import build_model
from strata.engine.core.models.registry import model_module, supported_model_types
from tests.helpers.tiny_models import make_tiny_hf_model

ATOL = 1e-4


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    directory, _ = make_tiny_hf_model("llama", tmp_path_factory.mktemp("llama"))
    return directory


@pytest.fixture
def llama_copy(llama_dir, tmp_path) -> Path:
    """A private copy of the tiny llama directory that a test may damage."""
    return Path(shutil.copytree(llama_dir, tmp_path / "copy"))


def edit_config(directory: Path, **changes) -> None:
    path = directory / "config.json"
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def load_error(directory) -> str:
    """The message of the ModelFormatError that loading and building `directory` raises."""
    with pytest.raises(ModelFormatError) as info:
        config = load_hf_config(directory)
        build_model(config, load_hf_tensors(directory, config))
    message = str(info.value)
    assert "\n" not in message
    return message


def logits(directory: Path, prompt: torch.Tensor) -> torch.Tensor:
    config = load_hf_config(directory)
    model = build_model(config, load_hf_tensors(directory, config))
    with torch.no_grad():
        return model(prompt, 0, KVCache.for_config(config, prompt.numel()))


# ---- config.json ----------------------------------------------------------------------------


def test_config_reads_transformers5_rope_parameters(tmp_path):
    directory, _ = make_tiny_hf_model("llama_llama3_rope", tmp_path)
    assert "rope_theta" not in json.loads((directory / "config.json").read_text())
    config = load_hf_config(directory)
    assert config.rope_theta == 500000.0
    assert config.rope_scaling["rope_type"] == "llama3"
    assert config.rope_scaling["factor"] == 8.0


def test_config_reads_the_older_top_level_rope_keys(llama_copy):
    scaling = {
        "rope_type": "llama3",
        "factor": 4.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    edit_config(llama_copy, rope_parameters=None, rope_theta=123456.0, rope_scaling=scaling)
    config = load_hf_config(llama_copy)
    assert config.rope_theta == 123456.0
    assert config.rope_scaling == scaling


def test_config_of_each_family(tmp_path):
    qwen2 = load_hf_config(make_tiny_hf_model("qwen2", tmp_path)[0])
    assert qwen2.attention_bias and qwen2.rope_theta == 1e6 and qwen2.rope_scaling is None
    moe = load_hf_config(make_tiny_hf_model("qwen3_moe_mixed", tmp_path)[0])
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (4, 2, 32)
    assert moe.mlp_only_layers == (0,) and moe.norm_topk_prob is False
    mixtral = load_hf_config(make_tiny_hf_model("mixtral", tmp_path)[0])
    assert (mixtral.num_experts, mixtral.moe_intermediate_size) == (4, 96)
    assert mixtral.head_dim == 16


# ---- tensors on disk ------------------------------------------------------------------------


def test_canonical_names_for_moe_files(tmp_path):
    for variant in ("qwen3_moe", "mixtral"):
        directory, _ = make_tiny_hf_model(variant, tmp_path)
        config = load_hf_config(directory)
        tensors = load_hf_tensors(directory, config)
        prefix = "model.layers.1.mlp"
        assert tensors[f"{prefix}.router.weight"].shape == (config.num_experts, 64)
        expert_shape = (config.num_experts, config.moe_intermediate_size, 64)
        assert tensors[f"{prefix}.experts.gate_proj"].shape == expert_shape
        assert tensors[f"{prefix}.experts.up_proj"].shape == expert_shape
        assert tensors[f"{prefix}.experts.down_proj"].shape == (*expert_shape[::2], expert_shape[1])
        assert not [n for n in tensors if "block_sparse_moe" in n or ".experts.0." in n]


@pytest.mark.parametrize("variant", ["qwen3_moe", "mixtral"])
def test_fused_transformers5_expert_layout_loads(variant, tmp_path):
    """A file written from the in-memory state dict has fused gate_up_proj experts."""
    directory, hf_model = make_tiny_hf_model(variant, tmp_path)
    state = {k: v.contiguous() for k, v in hf_model.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    (directory / "model.safetensors").unlink()
    save_file(state, str(directory / "model.safetensors"))
    prompt = torch.arange(33) % 320
    with torch.no_grad():
        expected = hf_model(prompt[None]).logits[0]
    torch.testing.assert_close(logits(directory, prompt), expected, atol=ATOL, rtol=0)


def test_sharded_directory_loads_like_one_file(llama_dir, tmp_path):
    # Same seed as llama_dir, so the same weights.
    sharded, _ = make_tiny_hf_model("llama", tmp_path / "sharded", max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    config = load_hf_config(sharded)
    one, many = load_hf_tensors(llama_dir, config), load_hf_tensors(sharded, config)
    assert one.keys() == many.keys()
    for name in one:
        assert torch.equal(one[name], many[name]), name


def test_bfloat16_files_widen_to_float32(tmp_path):
    _, hf_model = make_tiny_hf_model("qwen2", tmp_path)
    hf_model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    config = load_hf_config(tmp_path / "bf16")
    tensors = load_hf_tensors(tmp_path / "bf16", config)
    on_disk = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    assert all(t.dtype == torch.float32 for t in tensors.values())
    name = "model.layers.0.self_attn.q_proj.bias"
    assert on_disk[name].dtype == torch.bfloat16
    assert torch.equal(tensors[name], on_disk[name].float())


def test_tied_model_shares_the_embedding_and_ignores_a_written_head(tmp_path):
    directory, _ = make_tiny_hf_model("smollm2", tmp_path)
    path = directory / "model.safetensors"
    state = load_file(str(path))
    assert "lm_head.weight" not in state
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    save_file(state, str(path))
    config = load_hf_config(directory)
    model = build_model(config, load_hf_tensors(directory, config))
    assert "lm_head.weight" not in dict(model.named_parameters())


def test_build_does_not_copy_matching_tensors(llama_dir):
    config = load_hf_config(llama_dir)
    tensors = load_hf_tensors(llama_dir, config)
    pointers = {name: t.data_ptr() for name, t in tensors.items()}
    model = build_model(config, tensors, "cpu", torch.float32)
    for name, param in model.named_parameters():
        assert param.data_ptr() == pointers[name], name
    half = build_model(config, load_hf_tensors(llama_dir, config), "cpu", torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in half.parameters())


# ---- errors ---------------------------------------------------------------------------------


def test_missing_directory(tmp_path):
    message = load_error(tmp_path / "nowhere")
    assert "model directory" in message and "not found" in message
    assert "needs config.json and *.safetensors" in message


def test_missing_config(llama_copy):
    (llama_copy / "config.json").unlink()
    message = load_error(llama_copy)
    assert message.startswith("config.json not found in")
    assert "needs config.json and *.safetensors" in message


def test_missing_safetensors(llama_copy):
    (llama_copy / "model.safetensors").unlink()
    message = load_error(llama_copy)
    assert message.startswith("no *.safetensors found in")


def test_damaged_config_json(llama_copy):
    (llama_copy / "config.json").write_text('{"model_type": "llama",')
    assert "is not valid JSON" in load_error(llama_copy)


def test_config_without_a_required_key(llama_copy):
    data = json.loads((llama_copy / "config.json").read_text())
    del data["hidden_size"]
    (llama_copy / "config.json").write_text(json.dumps(data))
    assert "lacks 'hidden_size'" in load_error(llama_copy)


def test_unsupported_architecture(llama_copy):
    edit_config(llama_copy, model_type="gpt_neox")
    message = load_error(llama_copy)
    assert message.startswith("unsupported architecture 'gpt_neox'")
    for model_type in supported_model_types():
        assert model_type in message


def test_registry_names_the_supported_types():
    assert model_module("qwen3_moe").Model is not None
    with pytest.raises(ModelFormatError, match="llama, qwen2, qwen3, qwen3_moe, mixtral"):
        model_module("gpt_neox")


@pytest.mark.parametrize("keep_fraction", [0.5, 0.999])
def test_truncated_safetensors(llama_copy, keep_fraction):
    path = llama_copy / "model.safetensors"
    size = path.stat().st_size
    with path.open("r+b") as f:
        f.truncate(int(size * keep_fraction))
    message = load_error(llama_copy)
    assert "model.safetensors is truncated or damaged" in message and "download it again" in message


def test_missing_shard_named_by_the_index(tmp_path):
    sharded, _ = make_tiny_hf_model("llama", tmp_path, max_shard_size="100KB")
    victim = max(sharded.glob("*.safetensors"))
    victim.unlink()
    message = load_error(sharded)
    assert f"shard {victim.name} named in model.safetensors.index.json not found" in message


def test_shape_mismatch(llama_copy):
    edit_config(llama_copy, intermediate_size=80)
    assert load_error(llama_copy) == (
        "tensor model.layers.0.mlp.gate_proj.weight has shape (96, 64) but the config expects "
        "(80, 64): the file is damaged or its config.json does not match"
    )


def test_missing_tensor(llama_copy):
    path = llama_copy / "model.safetensors"
    state = load_file(str(path))
    del state["model.layers.1.self_attn.k_proj.weight"]
    save_file(state, str(path))
    assert load_error(llama_copy).startswith(
        "missing tensor model.layers.1.self_attn.k_proj.weight:"
    )


def test_unexpected_tensor(llama_copy):
    path = llama_copy / "model.safetensors"
    state = load_file(str(path))
    state["model.layers.0.self_attn.rel_bias"] = torch.zeros(4)
    save_file(state, str(path))
    assert load_error(llama_copy).startswith("unexpected tensor model.layers.0.self_attn.rel_bias:")


def test_missing_expert(tmp_path):
    directory, _ = make_tiny_hf_model("mixtral", tmp_path)
    path = directory / "model.safetensors"
    state = load_file(str(path))
    del state["model.layers.0.block_sparse_moe.experts.2.w3.weight"]
    save_file(state, str(path))
    message = load_error(directory)
    assert message.startswith("missing tensor model.layers.0.mlp.experts.2.up_proj.weight:")


def test_quantized_dtype_is_refused(llama_copy):
    path = llama_copy / "model.safetensors"
    state = load_file(str(path))
    state["model.norm.weight"] = state["model.norm.weight"].to(torch.int8)
    save_file(state, str(path))
    message = load_error(llama_copy)
    assert "tensor model.norm.weight in model.safetensors has dtype I8" in message


def test_unsupported_rope_scaling(llama_copy):
    edit_config(llama_copy, rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e4})
    assert load_error(llama_copy).startswith("RoPE scaling type 'dynamic' is not supported")


def test_glm_mtp_layer_of_a_checkpoint_is_dropped_with_a_log_line(tmp_path, caplog):
    """Published GLM-4.5 checkpoints carry their MTP layer as model.layers.{num_hidden_layers}
    (transformers ignores it on load); Strata drops it too, and says so."""
    directory, hf_model = make_tiny_hf_model("glm4_moe", tmp_path)
    layers, hidden = hf_model.config.num_hidden_layers, hf_model.config.hidden_size
    mtp = {f"model.layers.{layers}.eh_proj.weight": torch.randn(hidden, 2 * hidden),
           f"model.layers.{layers}.enorm.weight": torch.ones(hidden),
           f"model.layers.{layers}.mlp.gate.weight": torch.randn(8, hidden)}
    save_file(mtp, str(directory / "mtp.safetensors"))
    config = load_hf_config(directory)
    with caplog.at_level("INFO", logger="strata.engine.core.models.glm4_moe"):
        tensors = load_hf_tensors(directory, config)
    assert not any(name.startswith(f"model.layers.{layers}.") for name in tensors)
    assert f"dropping 3 tensors of the MTP (next-token prediction) layers [{layers}]" in \
        caplog.text
    model = build_model(config, tensors)  # everything else is the model's, checked
    prompt = torch.arange(12)
    torch.testing.assert_close(model(prompt, 0, KVCache.for_config(config, 16)),
                               hf_model(prompt[None]).logits[0].detach(), atol=1e-4, rtol=0)
