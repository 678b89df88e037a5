"""A tiny random Llama written as GGUF (F32, F16, Q8_0) and run by the Engine equals transformers.

The oracle for a quantized file is transformers running the same dequantized weights: each
tensor goes through the writer's own encoding and the gguf package's reference dequantizer,
then into a copy of the HF model. So the tolerance stays 1e-4 for every type, and a loader
that mixed up blocks, scales, names or the Q/K permutation cannot hide inside a quantization
tolerance.
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
from strata.engine.core.kv_cache import KVCache
from strata.engine.protocol import SamplingSpec
from tests.helpers.gguf_writer import _encode, write_gguf_from_hf
from tests.helpers.tiny_models import make_tiny_hf_config, randomize_norms

ATOL = 1e-4
PROMPT_TOKENS = 40
NEW_TOKENS = 20
QTYPES = ["F32", "F16", "Q8_0"]
# "llama": untied head, GQA; "smollm2": the default model's shape family (tied embeddings);
# "gemma3": norms stored as 1 + w, its window and soft-cap in metadata, and QAT's Q4_0.
# "phi3*": fused qkv and gate_up in the file (quantized blocks split by rows), partial RoPE
# and LongRoPE from the file's metadata and factor tensors; "mistral": head_dim 32 != 64 / 4,
# written as llama (as llama.cpp writes Mistral Small 3.x), so it loads as llama;
# "ministral3": arch mistral3, YaRN's betas and log multiplier and the query temperature from
# metadata, the temperature's period (8) well inside the prompt.
VARIANTS = ["llama", "smollm2", "gemma3", "phi3", "phi3_partial_longrope", "mistral",
            "ministral3"]
EXTRA_QTYPES = {"gemma3": ["Q4_0"]}
LOADS_AS = {"gemma3": "gemma3_text", "phi3": "phi3", "phi3_partial_longrope": "phi3",
            "ministral3": "ministral3"}
# What a GGUF cannot say, llama.cpp derives: Gemma 3's query scale is 1/sqrt(head_dim) but
# for the 27B, so the model written here has that scale.
GGUF_CONFIG_CHANGES = {"gemma3": {"query_pre_attn_scalar": 16}}


@functools.cache
def hf_model(variant: str):
    import transformers

    torch.manual_seed(0)
    config = make_tiny_hf_config(variant)
    for key, value in GGUF_CONFIG_CHANGES.get(variant, {}).items():
        setattr(config, key, value)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_norms(model, variant)
    return model.eval()


def as_stored(values: np.ndarray, qtype: str) -> np.ndarray:
    """What a tensor reads back as after the writer stored it as `qtype` (float32)."""
    # The writer's own encoding decides per tensor: 1-D stays F32, partial blocks fall back to F16.
    data, written = _encode(values, QT[qtype], np.random.default_rng(0))
    if written == QT.F32:
        return data
    return gguf.quants.dequantize(data, written).astype(np.float32).reshape(values.shape)


def hf_model_on_stored_weights(model, qtype: str):
    """A copy of `model` whose weights are exactly what the GGUF file holds, dequantized."""
    stored = copy.deepcopy(model)
    state = {name: torch.from_numpy(as_stored(t.detach().float().numpy(), qtype))
             for name, t in model.state_dict().items()}
    stored.load_state_dict(state)
    return stored.eval()


@pytest.fixture(scope="module",
                params=[(v, q) for v in VARIANTS for q in QTYPES + EXTRA_QTYPES.get(v, [])],
                ids=lambda p: f"{p[0]}-{p[1]}")
def case(request, tmp_path_factory):
    """(qtype, Engine on the GGUF, transformers on the stored weights, original HF, prompt,
    variant)."""
    variant, qtype = request.param
    model = hf_model(variant)
    path = write_gguf_from_hf(model, None, tmp_path_factory.mktemp(variant) / f"m-{qtype}.gguf",
                              qtype)
    engine = Engine(EngineConfig(model_path=str(path), device="cpu", context_tokens=128))
    engine.load()
    generator = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, model.config.vocab_size, (PROMPT_TOKENS,), generator=generator)
    yield qtype, engine, hf_model_on_stored_weights(model, qtype), model, prompt, variant
    engine.close()


@torch.no_grad()
def engine_logits(engine: Engine, prompt: torch.Tensor) -> torch.Tensor:
    kv = KVCache.for_config(engine.model_config, PROMPT_TOKENS, torch.float32, "cpu")
    return engine.model(prompt, 0, kv)  # [T, V]


@torch.no_grad()
def hf_logits(model, prompt: torch.Tensor) -> torch.Tensor:
    return model(prompt[None]).logits[0].float()  # [T, V]


def test_engine_loads_the_gguf_as_its_architecture(case) -> None:
    _, engine, _, model, _, variant = case
    info = engine.info()
    assert info["model_type"] == LOADS_AS.get(variant, "llama") and info["dtype"] == "float32"
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    assert engine.model_config.head_dim == head_dim
    assert engine.model_config.tie_word_embeddings == model.config.tie_word_embeddings
    assert info["parameter_count"] == sum(
        p.numel() for name, p in model.named_parameters())


def test_logits_match_transformers_on_the_stored_weights(case) -> None:
    _, engine, stored, _, prompt, _ = case
    got = engine_logits(engine, prompt)
    torch.testing.assert_close(got, hf_logits(stored, prompt), atol=ATOL, rtol=0)


def test_quantized_files_really_differ_from_the_float_weights(case) -> None:
    """Guards the oracle: F16 and Q8_0 change the logits by far more than ATOL (about 0.02 and
    1.0 here), so the equality above holds only if the dequantized values are the file's own."""
    qtype, engine, _, original, prompt, _ = case
    difference = (engine_logits(engine, prompt) - hf_logits(original, prompt)).abs().max()
    if qtype == "F32":
        assert difference <= ATOL
    else:
        assert difference > 10 * ATOL


def test_twenty_greedy_tokens_equal_transformers(case) -> None:
    _, engine, stored, _, prompt, _ = case
    spec = SamplingSpec(max_tokens=NEW_TOKENS, temperature=0.0)
    ours = [t for ids in engine.generate(prompt.tolist(), spec) for t in ids]
    with torch.no_grad():
        out = stored.generate(prompt[None], max_new_tokens=NEW_TOKENS,
                              min_new_tokens=NEW_TOKENS, do_sample=False)
    assert ours == out[0, PROMPT_TOKENS:].tolist()
    assert engine.last_usage.completion_tokens == NEW_TOKENS


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_glm4_moe_gguf_runs_like_transformers(qtype, tmp_path) -> None:
    """GLM-4.5's shape (sigmoid routing with the correction bias, shared expert, dense first
    layer, partial RoPE, MTP block in the file) loaded by the Engine from a GGUF gives the
    logits and greedy tokens of transformers on the weights the file holds."""
    import transformers

    from tests.helpers.tiny_models import randomize_routing_biases

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        make_tiny_hf_config("glm4_moe"), dtype=torch.float32).eval()
    randomize_routing_biases(model)
    path = write_gguf_from_hf(model, None, tmp_path / f"glm-{qtype}.gguf", qtype)
    stored = hf_model_on_stored_weights(model, qtype)
    engine = Engine(EngineConfig(model_path=str(path), device="cpu", context_tokens=128))
    engine.load()
    try:
        assert engine.info()["model_type"] == "glm4_moe"
        prompt = torch.randint(0, model.config.vocab_size, (PROMPT_TOKENS,),
                               generator=torch.Generator().manual_seed(7))
        got = engine_logits(engine, prompt)
        torch.testing.assert_close(got, hf_logits(stored, prompt), atol=ATOL, rtol=0)
        spec = SamplingSpec(max_tokens=NEW_TOKENS, temperature=0.0)
        ours = [t for ids in engine.generate(prompt.tolist(), spec) for t in ids]
        with torch.no_grad():
            out = stored.generate(prompt[None], max_new_tokens=NEW_TOKENS,
                                  min_new_tokens=NEW_TOKENS, do_sample=False)
        assert ours == out[0, PROMPT_TOKENS:].tolist()
    finally:
        engine.close()
