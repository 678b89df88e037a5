"""Every architecture against transformers on tiny random models: logits and greedy tokens.

The model goes through the real path (save_pretrained -> loader/hf.py -> build_model), so a
naming, layout or RoPE mistake anywhere shows up as a logits mismatch.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from strata.engine.core.kv_cache import KVCache
from strata.engine.core.loader.hf import load_hf_config, load_hf_tensors
from strata.engine.core.model_config import ModelConfig
from strata.engine.core.models.build import build_model
from strata.engine.core.models.switch import SparseMoE
from tests.helpers.tiny_models import VARIANTS, make_tiny_hf_model

PROMPT_TOKENS = 40
NEW_TOKENS = 20
MAX_TOKENS = 64
ATOL = 1e-4


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(request, tmp_path_factory):
    """(variant, our model, config, transformers model, prompt ids [PROMPT_TOKENS])."""
    variant = request.param
    directory, hf_model = make_tiny_hf_model(variant, tmp_path_factory.mktemp(variant))
    config = load_hf_config(directory)
    model = build_model(config, load_hf_tensors(directory, config), "cpu", torch.float32)
    generator = torch.Generator().manual_seed(1234)
    prompt = torch.randint(0, config.vocab_size, (PROMPT_TOKENS,), generator=generator)
    return variant, model, config, hf_model, prompt


@torch.no_grad()
def reference_logits(hf_model, prompt: torch.Tensor) -> torch.Tensor:
    return hf_model(prompt[None]).logits[0].float()  # [T, V]


@torch.no_grad()
def test_prefill_matches_transformers(pair):
    _, model, config, hf_model, prompt = pair
    kv = KVCache.for_config(config, MAX_TOKENS)
    logits = model(prompt, 0, kv)
    assert logits.shape == (PROMPT_TOKENS, config.vocab_size)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, reference_logits(hf_model, prompt), atol=ATOL, rtol=0)


@torch.no_grad()
def test_chunked_and_single_token_steps_match_transformers(pair):
    _, model, config, hf_model, prompt = pair
    kv = KVCache.for_config(config, MAX_TOKENS)
    # A first chunk, a second chunk after cached tokens (start_pos > 0 and T > 1), then
    # the last few tokens one at a time.
    pieces = [model(prompt[:24], 0, kv), model(prompt[24:34], 24, kv)]
    pieces += [model(prompt[i : i + 1], i, kv) for i in range(34, PROMPT_TOKENS)]
    logits = torch.cat(pieces)
    torch.testing.assert_close(logits, reference_logits(hf_model, prompt), atol=ATOL, rtol=0)


@torch.no_grad()
def greedy(model, config, prompt: torch.Tensor, num_new: int, kv: KVCache | None = None):
    kv = kv or KVCache.for_config(config, MAX_TOKENS)
    logits = model(prompt, 0, kv)
    tokens = []
    for step in range(num_new):
        token = int(logits[-1].argmax())
        tokens.append(token)
        if step + 1 < num_new:
            logits = model(torch.tensor([token]), PROMPT_TOKENS + step, kv)
    return tokens


@torch.no_grad()
def test_greedy_tokens_match_generate(pair):
    _, model, config, hf_model, prompt = pair
    expected = hf_model.generate(prompt[None], max_new_tokens=NEW_TOKENS, do_sample=False)
    expected = expected[0, PROMPT_TOKENS:].tolist()
    assert len(expected) == NEW_TOKENS
    assert greedy(model, config, prompt, NEW_TOKENS) == expected


@torch.no_grad()
def test_llama3_rope_scaling_changes_the_result(tmp_path):
    # Guards the parity test above: if the scaling were ignored, logits would differ.
    directory, hf_model = make_tiny_hf_model("llama_llama3_rope", tmp_path)
    config = load_hf_config(directory)
    assert config.rope_scaling["rope_type"] == "llama3"
    plain = dataclasses.replace(config, rope_scaling=None)
    model = build_model(plain, load_hf_tensors(directory, plain))
    prompt = torch.arange(PROMPT_TOKENS) % config.vocab_size
    logits = model(prompt, 0, KVCache.for_config(plain, MAX_TOKENS))
    assert (logits - reference_logits(hf_model, prompt)).abs().max() > 1e-2


@pytest.mark.parametrize("extra", [
    {"truncate": False},  # gpt-oss
    {},  # transformers' default: the ramp's ends rounded outwards
    {"mscale": 0.707, "mscale_all_dim": 0.707},  # DeepSeek-style ratio
    {"attention_factor": 1.25, "beta_fast": 16.0, "beta_slow": 2.0},
])
def test_yarn_frequencies_and_attention_factor_equal_transformers(extra):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from strata.engine.core.models.layers import rope_attention_factor, rope_inverse_frequencies

    rope = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
            "original_max_position_embeddings": 4096, **extra}
    hf = LlamaConfig(hidden_size=256, num_attention_heads=4, max_position_embeddings=131072,
                     rope_parameters=rope)
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    ours = ModelConfig.from_hf_dict({**hf.to_dict(), "model_type": "llama"})
    assert ours.rope_scaling["rope_type"] == "yarn"
    torch.testing.assert_close(rope_inverse_frequencies(ours), inv_freq, rtol=0, atol=0)
    assert rope_attention_factor(ours) == pytest.approx(factor, rel=1e-12)


@pytest.mark.parametrize("change", ["no_window", "no_sinks", "no_yarn"])
@torch.no_grad()
def test_gpt_oss_window_sinks_and_yarn_change_the_result(tmp_path, change):
    # Guards the gpt_oss parity above: the prompt is longer than the sliding window, the
    # sinks and YaRN's scaling (attention factor included) each move the logits.
    directory, hf_model = make_tiny_hf_model("gpt_oss", tmp_path)
    config = load_hf_config(directory)
    assert config.sliding_window < PROMPT_TOKENS and config.rope_scaling["rope_type"] == "yarn"
    if change == "no_window":
        config = dataclasses.replace(config, sliding_window=None, layer_types=())
    elif change == "no_yarn":
        config = dataclasses.replace(config, rope_scaling=None)
    tensors = load_hf_tensors(directory, config)
    if change == "no_sinks":
        for name in [n for n in tensors if n.endswith(".sinks")]:
            tensors[name] = torch.full_like(tensors[name], -1e9)
    model = build_model(config, tensors)
    prompt = torch.arange(PROMPT_TOKENS) % config.vocab_size
    logits = model(prompt, 0, KVCache.for_config(config, MAX_TOKENS))
    assert (logits - reference_logits(hf_model, prompt)).abs().max() > 1e-3


@torch.no_grad()
def test_kv_buffers_from_an_allocate_hook_are_used(tmp_path):
    """The KV arena will hand out views over one range; the model must write through them."""
    directory, hf_model = make_tiny_hf_model("qwen3", tmp_path)
    config = load_hf_config(directory)
    model = build_model(config, load_hf_tensors(directory, config))
    per_buffer = MAX_TOKENS * config.num_key_value_heads * config.head_dim
    arena = torch.zeros(2 * config.num_hidden_layers * per_buffer)
    handed_out = []

    def allocate(shape, dtype):
        start = len(handed_out) * per_buffer
        view = arena[start : start + per_buffer].view(shape)
        handed_out.append(view)
        return view

    kv = KVCache.for_config(config, MAX_TOKENS, allocate=allocate)
    assert len(handed_out) == 2 * config.num_hidden_layers
    assert kv.nbytes == arena.nbytes
    assert kv.bytes_per_token * MAX_TOKENS == kv.nbytes
    prompt = torch.arange(PROMPT_TOKENS) % config.vocab_size
    logits = model(prompt, 0, kv)
    torch.testing.assert_close(logits, reference_logits(hf_model, prompt), atol=ATOL, rtol=0)
    written = arena.view(2 * config.num_hidden_layers, MAX_TOKENS, -1)
    assert written[:, :PROMPT_TOKENS].abs().sum(dim=-1).gt(0).all()
    assert written[:, PROMPT_TOKENS:].eq(0).all()


def test_kv_cache_rejects_a_hook_with_the_wrong_shape():
    with pytest.raises(ValueError, match="allocate hook returned"):
        KVCache(2, 2, 16, 8, torch.float32, "cpu", allocate=lambda shape, dtype: torch.zeros(4))


@torch.no_grad()
def test_forward_past_the_kv_capacity_is_refused(pair):
    _, model, config, _, prompt = pair
    kv = KVCache.for_config(config, 16)
    with pytest.raises(ValueError, match="do not fit the KV cache of 16 tokens"):
        model(prompt[:17], 0, kv)


class RecordingExperts:
    """An ExpertWeights provider that serves copies of the stacked experts and logs the ids."""

    def __init__(self, layer: SparseMoE, scale: float = 1.0):
        self.gate = layer.experts.gate_proj.clone() * scale
        self.up = layer.experts.up_proj.clone()
        self.down = layer.experts.down_proj.clone()
        self.requested: list[list[int]] = []

    def get(self, expert_ids):
        self.requested.append(list(expert_ids))
        index = torch.tensor(expert_ids)
        # Stacked [k, ...] copies, the shape ExpertStore.fetch returns.
        return self.gate[index], self.up[index], self.down[index]


@torch.no_grad()
def test_moe_layers_take_expert_weights_from_a_provider(tmp_path):
    directory, hf_model = make_tiny_hf_model("qwen3_moe", tmp_path)
    config = load_hf_config(directory)
    model = build_model(config, load_hf_tensors(directory, config))
    moe_layers = [m for m in model.modules() if isinstance(m, SparseMoE)]
    assert len(moe_layers) == config.num_hidden_layers
    prompt = torch.arange(PROMPT_TOKENS) % config.vocab_size
    expected = reference_logits(hf_model, prompt)

    providers = [RecordingExperts(layer) for layer in moe_layers]
    for layer, provider in zip(moe_layers, providers):
        layer.expert_weights = provider
    logits = model(prompt, 0, KVCache.for_config(config, MAX_TOKENS))
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)
    for provider in providers:
        (ids,) = provider.requested  # one batched request per layer and call
        assert ids == sorted(set(ids)) and ids[0] >= 0 and ids[-1] < config.num_experts

    # Different weights from the provider must change the output: it is really used.
    for layer in moe_layers:
        layer.expert_weights = RecordingExperts(layer, scale=0.0)
    logits = model(prompt, 0, KVCache.for_config(config, MAX_TOKENS))
    assert (logits - expected).abs().max() > 1e-2


@pytest.mark.parametrize("change", [
    {"sliding_window": 10_000},  # the window cuts nothing
    {"layer_types": ("sliding_attention",) * 6},  # no global layer
    {"rope_local_theta": 1e6},  # the local layers read the global base
    {"rope_scaling": None},  # the global layers' linear scaling ignored
    {"query_pre_attn_scalar": None},  # 1/sqrt(head_dim)
    {"final_logit_softcapping": None},
], ids=lambda change: next(iter(change)))
@torch.no_grad()
def test_each_gemma3_feature_changes_the_result(tmp_path, change):
    # Guards the parity tests above: a Gemma 3 feature ignored would change the logits.
    directory, hf_model = make_tiny_hf_model("gemma3", tmp_path)
    config = load_hf_config(directory)
    assert config.layer_types[-1] == "full_attention" and config.sliding_window == 8
    assert 4 * config.sliding_window < PROMPT_TOKENS
    changed = dataclasses.replace(config, **change)
    model = build_model(changed, load_hf_tensors(directory, changed))
    prompt = torch.arange(PROMPT_TOKENS) % config.vocab_size
    logits = model(prompt, 0, KVCache.for_config(changed, MAX_TOKENS))
    assert (logits - reference_logits(hf_model, prompt)).abs().max() > 1e-2


def _without_correction_bias(model):
    for name, param in model.named_parameters():
        if name.endswith("e_score_correction_bias"):
            param.zero_()


@torch.no_grad()
@pytest.mark.parametrize("change", ["no_correction_bias", "one_group", "no_scaling",
                                    "full_rotary", "no_shared_expert"])
def test_each_glm_routing_feature_changes_the_result(change, tmp_path):
    """Guards the glm4_moe parity: the tiny config exercises every GLM feature, so a model
    that skipped any of them would not match transformers."""
    directory, hf_model = make_tiny_hf_model("glm4_moe", tmp_path)
    config = load_hf_config(directory)
    tensors = load_hf_tensors(directory, config)
    if change == "one_group":
        config = dataclasses.replace(config, n_group=1, topk_group=1)
    elif change == "no_scaling":
        config = dataclasses.replace(config, routed_scaling_factor=1.0)
    elif change == "full_rotary":
        config = dataclasses.replace(config, partial_rotary_factor=1.0)
    elif change == "no_shared_expert":
        for name in [n for n in tensors if ".shared_experts." in n]:
            tensors[name] = torch.zeros_like(tensors[name])
    model = build_model(config, tensors)
    if change == "no_correction_bias":
        _without_correction_bias(model)
    prompt = torch.arange(PROMPT_TOKENS) % config.vocab_size
    logits = model(prompt, 0, KVCache.for_config(config, MAX_TOKENS))
    assert (logits - reference_logits(hf_model, prompt)).abs().max() > 1e-2
