"""GGUF loader: load(write_gguf(hf)) must equal the HF weights, for every arch and quant type."""

from __future__ import annotations

import dataclasses
import functools
import shutil

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from strata.engine.core.loader import inspect_model, load_model_config, load_tensors
from strata.engine.core.loader.gguf import (
    SUPPORTED_QUANT_TYPES,
    dequantize_tensor,
    load_gguf_config,
    load_gguf_tensors,
)
from strata.engine.core.loader.gguf_rope import llama3_freqs, llama3_scaling_from_freqs
from strata.engine.core.model_config import ModelConfig, ModelFormatError
from strata.engine.core.model_info import format_model_info
from tests.helpers.gguf_writer import write_gguf_from_hf
from tests.helpers.tiny_models import make_tiny_hf_config, randomize_routing_biases

VARIANTS = ["llama", "smollm2", "qwen2", "qwen3", "qwen3_moe_mixed", "mixtral", "llama_llama3_rope",
            "glm4_moe"]


@functools.cache
def hf_model(variant: str, **overrides):
    import transformers

    config = make_tiny_hf_config(variant)
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize_routing_biases(model)
    return model


def hf_canonical(model) -> dict[str, torch.Tensor]:
    """The HF state dict in Strata's canonical names (written out here, not via sanitize)."""
    out = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        if name.endswith("mlp.gate.weight") and ".experts" not in name:
            out[name.replace("mlp.gate.weight", "mlp.router.weight")] = tensor
        elif name.endswith("mlp.gate.e_score_correction_bias"):
            out[name.replace("gate.e_score", "e_score")] = tensor
        elif name.endswith("mlp.experts.gate_up_proj"):
            gate, up = tensor.chunk(2, dim=1)
            out[name.replace("gate_up_proj", "gate_proj")] = gate
            out[name.replace("gate_up_proj", "up_proj")] = up
        else:
            out[name] = tensor
    return out


def hf_inv_freq(rope_parameters: dict, head_dim: int) -> torch.Tensor:
    """transformers' own llama3 RoPE frequencies: the oracle for the recovered scaling."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.LlamaConfig(
        hidden_size=head_dim * 4, num_attention_heads=4, rope_parameters=dict(rope_parameters)
    )
    return ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")[0]


@pytest.mark.parametrize("qtype", ["F32", "F16", "Q8_0"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_gguf_tensors_equal_hf(variant, qtype, tmp_path):
    model = hf_model(variant)
    path = write_gguf_from_hf(model, None, tmp_path / "m.gguf", qtype)
    config = load_gguf_config(path)
    tensors = load_gguf_tensors(path, config)
    expected = hf_canonical(model)
    assert sorted(tensors) == sorted(expected)
    for name, want in expected.items():
        got = tensors[name]
        assert got.dtype == torch.float32 and got.shape == want.shape, name
        if qtype == "F32":
            assert torch.equal(got, want), name
        elif qtype == "F16" or want.ndim == 1 or want.shape[-1] % 32:
            torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-6, msg=name)
        else:  # Q8_0: half an int8 step, plus the fp16 rounding of the scale
            blocks = want.reshape(-1, 32)
            step = blocks.abs().amax(dim=1, keepdim=True) / 127
            err = (got.reshape(-1, 32) - blocks).abs()
            assert bool((err <= step * 0.6 + 1e-7).all()), name
            assert not torch.equal(got, want), name  # really quantized


@pytest.mark.parametrize("variant", VARIANTS)
def test_gguf_config_equals_hf_config(variant, tmp_path):
    model = hf_model(variant)
    path = write_gguf_from_hf(model, None, tmp_path / "m.gguf", "F16")
    got = load_gguf_config(path)
    want = ModelConfig.from_hf_dict(model.config.to_dict())
    assert dataclasses.replace(got, rope_scaling=None) == dataclasses.replace(
        want, rope_scaling=None
    )
    if want.rope_scaling is None:
        assert got.rope_scaling is None
    else:  # recovered parameters may differ in form; the frequencies they give may not
        params = {**got.rope_scaling, "rope_theta": got.rope_theta}
        torch.testing.assert_close(
            hf_inv_freq(params, got.head_dim),
            hf_inv_freq(model.config.rope_parameters, want.head_dim),
        )


def test_llama_q_k_are_permuted_in_the_file(tmp_path):
    """Guards the parity test: the file must hold rows in llama.cpp's order, not HF's."""
    model = hf_model("llama")
    path = write_gguf_from_hf(model, None, tmp_path / "m.gguf", "F32")
    raw = {t.name: t for t in gguf.GGUFReader(path).tensors}
    for gguf_name, hf_name in [("attn_q", "q_proj"), ("attn_k", "k_proj")]:
        stored = torch.from_numpy(np.array(raw[f"blk.0.{gguf_name}.weight"].data))
        hf = model.state_dict()[f"model.layers.0.self_attn.{hf_name}.weight"]
        assert stored.shape == hf.shape and not torch.equal(stored, hf)


def test_llama3_rope_scaling_recovered_from_rope_freqs():
    # Llama 3.2 1B's values: the fit must give them back exactly.
    scaling = {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    fitted = llama3_scaling_from_freqs(llama3_freqs(scaling, 500000.0, 64), 500000.0, 64)
    assert fitted == pytest.approx(scaling)
    assert llama3_scaling_from_freqs(np.ones(32, np.float32), 500000.0, 64) is None


def test_old_per_expert_mixtral_layout_is_stacked(tmp_path):
    model = hf_model("mixtral")
    path = write_gguf_from_hf(model, None, tmp_path / "m.gguf", "F32", per_expert_tensors=True)
    assert "blk.0.ffn_gate.3.weight" in {t.name for t in gguf.GGUFReader(path).tensors}
    tensors = load_gguf_tensors(path, load_gguf_config(path))
    expected = hf_canonical(model)
    assert sorted(tensors) == sorted(expected)
    assert all(torch.equal(tensors[n], expected[n]) for n in expected)


# ---- dequantization ------------------------------------------------------------------------

_QUANTIZABLE = {  # type -> largest allowed RMS error relative to the data's RMS
    "F32": 0.0, "F16": 1e-3, "BF16": 1e-2, "Q8_0": 1e-2,
    "Q5_0": 0.06, "Q5_1": 0.06, "Q4_0": 0.12, "Q4_1": 0.12, "MXFP4": 0.2,
}  # fmt: skip
_NOT_QUANTIZABLE_HERE = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS",
                         "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M"]


def test_supported_set_is_the_documented_one():
    assert {t.name for t in SUPPORTED_QUANT_TYPES} == set(_QUANTIZABLE) | set(_NOT_QUANTIZABLE_HERE)


@pytest.mark.parametrize("qtype", sorted(_QUANTIZABLE))
def test_quantize_then_dequantize_roundtrip(qtype):
    data = np.random.default_rng(1).standard_normal((8, 256)).astype(np.float32)
    raw = gguf.quants.quantize(data, QT[qtype])
    got = dequantize_tensor("w", QT[qtype], raw)
    assert got.shape == data.shape and got.dtype == np.float32 and got.flags.writeable
    rel_rms = np.sqrt(np.mean((got - data) ** 2) / np.mean(data**2))
    assert rel_rms <= _QUANTIZABLE[qtype]


@pytest.mark.parametrize("qtype", _NOT_QUANTIZABLE_HERE)
def test_k_quants_are_dequantized_row_by_row(qtype):
    # The gguf package cannot quantize K types; random blocks still check dispatch and layout.
    block_size, type_size = gguf.GGML_QUANT_SIZES[QT[qtype]]
    raw = np.random.default_rng(2).integers(0, 256, size=(4, type_size * 2), dtype=np.uint8)
    raw &= 0xBF  # clears the top fp16 exponent bit of every scale: finite values only
    got = dequantize_tensor("w", QT[qtype], raw)
    assert got.shape == (4, 2 * block_size) and got.dtype == np.float32
    assert np.isfinite(got).all()
    for row in range(4):
        want = gguf.quants.dequantize(raw[row : row + 1], QT[qtype])
        np.testing.assert_array_equal(got[row : row + 1], want)


# ---- entry points and ModelInfo -----------------------------------------------------------


def test_load_tensors_gguf_equals_load_tensors_hf_dir(tmp_path):
    model = hf_model("qwen3_moe_mixed")
    model.save_pretrained(tmp_path / "hf")
    path = write_gguf_from_hf(model, None, tmp_path / "m.gguf", "F32")
    from_gguf = load_tensors(path, load_model_config(path))
    from_hf = load_tensors(tmp_path / "hf", load_model_config(tmp_path / "hf"))
    assert sorted(from_gguf) == sorted(from_hf)
    assert all(torch.equal(from_gguf[n], from_hf[n]) for n in from_hf)


def test_inspect_gguf_without_dequantizing(tmp_path):
    model = hf_model("llama")
    path = write_gguf_from_hf(model, None, tmp_path / "m.gguf", "Q8_0")
    info = inspect_model(path)
    assert (info.format, info.model_type, info.context_tokens) == ("gguf", "llama", 256)
    assert info.parameter_count == sum(t.numel() for t in model.state_dict().values())
    assert info.quant_types["Q8_0"] == 2 * 7 + 2  # 7 linears per layer + embed + lm_head
    assert info.quant_types["F32"] == 2 * 2 + 1  # norms
    assert info.file_bytes == path.stat().st_size and not info.has_chat_template
    text = format_model_info(info)
    assert "Q8_0 x16" in text and "256 tokens" in text and "llama" in text


def test_inspect_hf_dir_and_gguf_chat_template(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    raw.train_from_iterator(["hello world, the quick brown fox"] * 20, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"

    model = hf_model("qwen3")
    model.save_pretrained(tmp_path / "hf")
    tokenizer.save_pretrained(tmp_path / "hf")
    info = inspect_model(tmp_path / "hf")
    assert (info.format, info.model_type, info.has_chat_template) == ("hf", "qwen3", True)
    assert info.parameter_count == model.num_parameters()  # tied embedding counted once
    assert info.quant_types == {"F32": len(hf_canonical(model))}

    path = write_gguf_from_hf(model, tokenizer, tmp_path / "m.gguf", "F16")
    config = load_gguf_config(path)
    assert config.vocab_size == model.config.vocab_size  # token list padded like llama.cpp
    assert config.bos_token_id == tokenizer.bos_token_id
    assert config.eos_token_ids == (tokenizer.eos_token_id,)
    assert inspect_model(path).has_chat_template


# ---- errors: one line, says what to do ----------------------------------------------------


def _one_line_error(fn, *args) -> str:
    with pytest.raises(ModelFormatError) as exc:
        fn(*args)
    message = str(exc.value)
    assert "\n" not in message
    return message


@pytest.fixture
def llama_gguf(tmp_path):
    return write_gguf_from_hf(hf_model("llama"), None, tmp_path / "m.gguf", "F16")


def test_missing_file(tmp_path):
    message = _one_line_error(load_model_config, tmp_path / "nope.gguf")
    assert "nope.gguf not found" in message and "strata pull" in message


def test_bad_magic(llama_gguf):
    data = bytearray(llama_gguf.read_bytes())
    data[:4] = b"GGUX"
    llama_gguf.write_bytes(bytes(data))
    assert "is not a GGUF file" in _one_line_error(load_model_config, llama_gguf)


def test_truncated_tensor_data(llama_gguf, tmp_path):
    need_bytes = max(t.data_offset + t.n_bytes for t in gguf.GGUFReader(llama_gguf).tensors)
    cut = tmp_path / "cut.gguf"
    shutil.copy(llama_gguf, cut)
    with open(cut, "r+b") as f:
        f.truncate(need_bytes - 1000)
    message = _one_line_error(load_model_config, cut)
    assert f"is truncated ({need_bytes - 1000} of {need_bytes} bytes): download it again" in message


def test_truncated_header(llama_gguf):
    with open(llama_gguf, "r+b") as f:
        f.truncate(200)
    assert "truncated or corrupt" in _one_line_error(load_model_config, llama_gguf)


def test_unsupported_quant_type_is_named(tmp_path):
    model = hf_model("llama", intermediate_size=256)  # TQ2_0 needs 256-wide rows
    path = write_gguf_from_hf(
        model,
        None,
        tmp_path / "m.gguf",
        "F16",
        qtype_overrides={"blk.0.ffn_down.weight": "TQ2_0"},
    )
    assert inspect_model(path).quant_types["TQ2_0"] == 1  # info works without dequantizing
    message = _one_line_error(load_gguf_tensors, path, load_gguf_config(path))
    assert message == (
        "tensor blk.0.ffn_down.weight uses quant type TQ2_0, which Strata cannot dequantize; "
        "use a Q4_K_M, Q8_0 or F16 file"
    )


def test_unsupported_architecture_is_named(tmp_path):
    path = write_gguf_from_hf(hf_model("llama"), None, tmp_path / "m.gguf", architecture="gpt2")
    message = _one_line_error(load_model_config, path)
    assert "'gpt2'" in message and "llama, qwen2, qwen3, qwen3moe" in message
    info = inspect_model(path)
    assert info.model_type == "gpt2" and not info.is_supported


def test_file_that_does_not_match_its_config(llama_gguf):
    config = load_gguf_config(llama_gguf)
    biased = dataclasses.replace(config, attention_bias=True)
    assert "lacks tensor blk.0.attn_q.bias" in _one_line_error(
        load_gguf_tensors, llama_gguf, biased
    )
    tied = dataclasses.replace(config, tie_word_embeddings=True)
    assert "has tensor output.weight" in _one_line_error(load_gguf_tensors, llama_gguf, tied)


def test_directory_without_config(tmp_path):
    assert "without config.json" in _one_line_error(load_model_config, tmp_path)


def test_glm_mtp_block_is_in_the_file_and_skipped_with_a_log_line(tmp_path, caplog):
    """Guards the glm4_moe rows above: the file carries the converter's extra MTP block."""
    model = hf_model("glm4_moe")
    path = write_gguf_from_hf(model, None, tmp_path / "m.gguf", "F16")
    reader = gguf.GGUFReader(path)
    names = {t.name for t in reader.tensors}
    layers = model.config.num_hidden_layers
    assert f"blk.{layers}.nextn.eh_proj.weight" in names
    assert f"blk.{layers}.ffn_gate_exps.weight" in names
    assert load_gguf_config(path).num_hidden_layers == layers
    with caplog.at_level("INFO", logger="strata.engine.core.loader.gguf"):
        tensors = load_gguf_tensors(path, load_gguf_config(path))
    assert not any(f"layers.{layers}." in name for name in tensors)
    assert f"MTP (next-token prediction) blocks from blk.{layers}" in caplog.text


def test_glm_gguf_config_reads_the_routing_keys(tmp_path):
    config = load_gguf_config(write_gguf_from_hf(hf_model("glm4_moe"), None,
                                                 tmp_path / "m.gguf", "F16"))
    assert (config.moe_scoring, config.routed_scaling_factor, config.n_shared_experts) == \
        ("sigmoid", 2.5, 1)
    assert (config.n_group, config.topk_group, config.mlp_only_layers) == (2, 1, (0,))
    assert config.rotary_dim == config.head_dim // 2 and config.use_qk_norm


def test_glm_file_without_its_correction_bias_names_the_tensor(tmp_path):
    path = write_gguf_from_hf(hf_model("glm4_moe"), None, tmp_path / "m.gguf", "F16",
                              edit_tensors=lambda t: t.pop("blk.2.exp_probs_b.bias"))
    message = _one_line_error(load_gguf_tensors, path, load_gguf_config(path))
    assert "lacks tensor blk.2.exp_probs_b.bias" in message


def test_glm_shared_expert_of_the_wrong_shape_is_named(tmp_path):
    from strata.engine.core.engine import Engine, EngineConfig

    def narrow(tensors):
        name = "blk.1.ffn_up_shexp.weight"
        tensors[name] = tensors[name][:16]

    path = write_gguf_from_hf(hf_model("glm4_moe"), None, tmp_path / "m.gguf", "F16",
                              edit_tensors=narrow)
    engine = Engine(EngineConfig(model_path=str(path), device="cpu", context_tokens=64))
    message = _one_line_error(engine.load)
    assert ("model.layers.1.mlp.shared_experts.up_proj.weight (blk.1.ffn_up_shexp.weight in "
            "the file) has shape (16, 64)") in message
