"""GPT-OSS beyond the transformers parity of test_models_parity.py: its GGUF (MXFP4 experts)
loads to the logits of the dequantized weights, OpenAI's MXFP4 safetensors form equals
transformers' own dequantization, damaged files name their tensor, and a real engine on the
CPU generates from a tiny gpt-oss GGUF, its experts released and refilled or in slots.

The oracle for a quantized file is transformers running the weights the file holds: each
expert tensor goes through gguf-py's MXFP4 quantizer and dequantizer in the GGUF layout, then
back into a copy of the HF model.
"""

from __future__ import annotations

import copy
import functools

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from strata.engine.core.engine import Engine, EngineConfig
from strata.engine.core.fast_coverage import missing_features
from strata.engine.core.kv_cache import KVCache
from strata.engine.core.loader import load_model_config, load_tensors
from strata.engine.core.loader.mxfp4_hf import openai_to_ggml
from strata.engine.core.model_config import ModelFormatError
from strata.engine.core.models.build import build_model
from strata.engine.protocol import SamplingSpec
from tests.core.engine_memory_helpers import make_engine, run
from tests.helpers.gguf_writer import gpt_oss_experts_to_gguf, write_gguf_from_hf
from tests.helpers.quant_blocks import save_experts_as_openai_mxfp4
from tests.helpers.tiny_models import make_tiny_hf_config, make_tiny_hf_model

PROMPT_TOKENS = 40  # longer than the tiny model's window of 8
NEW_TOKENS = 12
ATOL = 1e-4
NUM_LAYERS = 3
MXFP4_EXPERTS = {f"blk.{i}.ffn_{p}_exps.weight": "MXFP4"
                 for i in range(NUM_LAYERS) for p in ("gate", "up", "down")}
GREEDY = SamplingSpec(temperature=0.0, max_tokens=NEW_TOKENS)


@functools.cache
def hf_model():
    import transformers

    torch.manual_seed(0)
    config = make_tiny_hf_config("gpt_oss")
    assert config.num_hidden_layers == NUM_LAYERS
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def _mxfp4_roundtrip(values: np.ndarray) -> np.ndarray:
    raw = gguf.quants.quantize(values, QT.MXFP4)
    return gguf.quants.dequantize(raw, QT.MXFP4).astype(np.float32).reshape(values.shape)


def hf_model_on_mxfp4_experts(model):
    """A copy of model whose expert matrices are what an MXFP4 GGUF of it holds."""
    stored = copy.deepcopy(model)
    state = stored.state_dict()
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        split = gpt_oss_experts_to_gguf(name, state[name].numpy())
        back = {k: _mxfp4_roundtrip(v) for k, v in split.items()}
        if name.endswith("gate_up_proj"):  # [E, I, H] gate and up -> [E, H, 2I] interleaved
            fused = np.empty_like(state[name].numpy())
            fused[:, :, 0::2] = back[name[:-len("gate_up_proj")] + "gate_proj"].transpose(0, 2, 1)
            fused[:, :, 1::2] = back[name[:-len("gate_up_proj")] + "up_proj"].transpose(0, 2, 1)
        else:
            fused = back[name].transpose(0, 2, 1)
        state[name] = torch.from_numpy(np.ascontiguousarray(fused))
    stored.load_state_dict(state)
    return stored.eval()


@pytest.fixture(scope="module")
def mxfp4_gguf(tmp_path_factory):
    return write_gguf_from_hf(hf_model(), None, tmp_path_factory.mktemp("g") / "m.gguf", "F32",
                              qtype_overrides=MXFP4_EXPERTS)


def prompt_ids() -> torch.Tensor:
    generator = torch.Generator().manual_seed(7)
    return torch.randint(0, hf_model().config.vocab_size, (PROMPT_TOKENS,), generator=generator)


@torch.no_grad()
def test_mxfp4_gguf_loads_to_the_logits_of_its_dequantized_weights(mxfp4_gguf):
    config = load_model_config(mxfp4_gguf)
    assert config.model_type == "gpt_oss" and config.sliding_window == 8
    assert config.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    reader = gguf.GGUFReader(mxfp4_gguf)
    assert {t.tensor_type for t in reader.tensors if "_exps.weight" in t.name} == {QT.MXFP4}
    model = build_model(config, load_tensors(mxfp4_gguf, config))
    prompt = prompt_ids()
    logits = model(prompt, 0, KVCache.for_config(config, 64))
    expected = hf_model_on_mxfp4_experts(hf_model())(prompt[None]).logits[0]
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)
    # The oracle is not the float model: MXFP4 really moved the logits.
    assert (logits - hf_model()(prompt[None]).logits[0]).abs().max() > 1e-2


def test_openai_mxfp4_layout_equals_transformers_dequantization():
    from transformers.integrations.mxfp4 import _convert_moe_packed_tensors

    rng = np.random.default_rng(3)
    blocks = torch.from_numpy(rng.integers(0, 256, (3, 8, 4, 16), dtype=np.uint8))  # [E, N, K/32, 16]
    scales = torch.from_numpy(rng.integers(110, 140, (3, 8, 4), dtype=np.uint8))
    ggml = openai_to_ggml(blocks, scales)  # [E, N, K/32 * 17]
    assert ggml.shape == (3, 8, 4 * 17)
    ours = gguf.quants.dequantize(ggml.numpy(), QT.MXFP4).reshape(3, 8, 128)
    theirs = _convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, K, N]
    np.testing.assert_array_equal(ours, theirs.transpose(1, 2).numpy())


@torch.no_grad()
def test_openai_mxfp4_safetensors_load_like_transformers(tmp_path):
    """The original release's form: experts as *_blocks/*_scales in an HF directory."""
    directory, model = make_tiny_hf_model("gpt_oss", tmp_path)
    save_experts_as_openai_mxfp4(directory, model)
    config = load_model_config(directory)
    ours = build_model(config, load_tensors(directory, config))
    logits = ours(prompt_ids(), 0, KVCache.for_config(config, 64))
    torch.testing.assert_close(logits, model(prompt_ids()[None]).logits[0], atol=ATOL, rtol=0)


def _error(path) -> str:
    with pytest.raises(ModelFormatError) as info:
        config = load_model_config(path)
        build_model(config, load_tensors(path, config))
    message = str(info.value)
    assert "\n" not in message
    return message


def test_a_missing_tensor_is_named(tmp_path):
    path = write_gguf_from_hf(hf_model(), None, tmp_path / "m.gguf", "F32",
                              edit_tensors=lambda t: t.pop("blk.1.attn_sinks.weight"))
    assert "blk.1.attn_sinks.weight" in _error(path)


def test_a_misshapen_tensor_is_named(tmp_path):
    def shorten(tensors):
        tensors["blk.2.ffn_down_exps.bias"] = tensors["blk.2.ffn_down_exps.bias"][:, :-1].copy()

    path = write_gguf_from_hf(hf_model(), None, tmp_path / "m.gguf", "F32",
                              edit_tensors=shorten)
    message = _error(path)
    assert "model.layers.2.mlp.expert_bias.down" in message and "shape" in message


def test_fast_paths_name_what_they_lack(mxfp4_gguf):
    config = load_model_config(mxfp4_gguf)
    model = build_model(config, load_tensors(mxfp4_gguf, config))
    # Its attention (sinks, alternating windows, biases, YaRN: test_fast_paths.py::
    # test_gpt_oss_attention_on_the_fast_paths) and its MoE (router bias, softmax over the
    # top-k logits, expert biases, clamped SwiGLU, MXFP4 experts:
    # test_moe_layer_paths_match_reference) are both covered.
    assert missing_features(model) == []


@torch.no_grad()
def test_engine_takes_the_fast_path_with_transformers_tokens(mxfp4_gguf):
    """fast_compile_pointwise=True builds the fast decoder on the CPU too (what CPU tests of
    the load's compile use): gpt-oss takes it, MXFP4 experts, sinks and windows included, and
    its greedy tokens are transformers' on the same blocks."""
    config = EngineConfig(model_path=str(mxfp4_gguf), device="cpu", context_tokens=128,
                          fast_compile_pointwise=True)
    engine = Engine(config)
    engine.load()
    try:
        assert engine.fast is not None
        prompt = prompt_ids()
        tokens = run(engine, prompt.tolist(), spec=GREEDY)
        expected = hf_model_on_mxfp4_experts(hf_model()).generate(
            prompt[None], max_new_tokens=NEW_TOKENS, do_sample=False)[0, PROMPT_TOKENS:]
        assert tokens == expected.tolist()
    finally:
        engine.close()


@torch.no_grad()
def test_engine_generates_greedy_tokens_like_transformers(mxfp4_gguf):
    engine = Engine(EngineConfig(model_path=str(mxfp4_gguf), device="cpu", context_tokens=128))
    engine.load()
    try:
        prompt = prompt_ids()
        tokens = [t for ids in engine.generate(prompt.tolist(), GREEDY) for t in ids]
        expected = hf_model_on_mxfp4_experts(hf_model()).generate(
            prompt[None], max_new_tokens=NEW_TOKENS, do_sample=False)[0, PROMPT_TOKENS:]
        assert tokens == expected.tolist()
    finally:
        engine.close()


def test_expert_release_refill_and_slots_answer_alike(mxfp4_gguf, tmp_path):
    prompt = prompt_ids().tolist()
    engine = make_engine(mxfp4_gguf, tmp_path / "a", expert_cache="all")
    try:
        reference = run(engine, prompt, spec=GREEDY)
        assert len(reference) == NEW_TOKENS
        assert engine.release_experts()["freed_bytes"] > 0
        engine.refill_experts()
        assert run(engine, prompt, slot=1, spec=GREEDY) == reference
    finally:
        engine.close()
    # 3 layers x 8 experts; 10 slots hold fewer than all, so misses come from the host copy.
    slots = make_engine(mxfp4_gguf, tmp_path / "b", expert_cache="10")
    try:
        assert slots.status()["experts"]["mode"] == "slots"
        assert run(slots, prompt, spec=GREEDY) == reference
    finally:
        slots.close()
