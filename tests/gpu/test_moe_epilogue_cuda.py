"""GLM-4.5's and GPT-OSS's MoE layers on the GPU (what the CPU tests check interpreted,
tests/core/test_fast_paths.py): gpt-oss-20b's expert shape (32 experts, top 4, hidden and
width 2880) with MXFP4 experts, biases and the clamped SwiGLU, and a GLM layer with sigmoid
routing and a shared expert, in bf16 through the one-token kernels (in a CUDA graph too), a
batch's rows and the prefill path, against the reference module. Times nothing."""

from __future__ import annotations

import dataclasses

import gguf
import pytest
import torch

from strata.engine.core.model_config import ModelConfig
from strata.engine.core.quant.experts import QuantizedExperts
from strata.engine.core.random_weights import build_random_model

pytestmark = pytest.mark.gpu

GPT_OSS_20B = ModelConfig(model_type="gpt_oss", vocab_size=256, hidden_size=2880,
                          intermediate_size=2880, num_hidden_layers=1, num_attention_heads=8,
                          num_key_value_heads=2, head_dim=64, num_experts=32,
                          num_experts_per_tok=4, moe_intermediate_size=2880,
                          attention_bias=True)
GLM_AIR_LIKE = ModelConfig(model_type="glm4_moe", vocab_size=256, hidden_size=1024,
                           intermediate_size=2048, num_hidden_layers=2, num_attention_heads=8,
                           num_key_value_heads=2, head_dim=128, num_experts=64,
                           num_experts_per_tok=8, moe_intermediate_size=512,
                           mlp_only_layers=(0,), routed_scaling_factor=1.0,
                           n_shared_experts=1, attention_bias=True)


def _mxfp4(moe) -> None:
    """The layer's experts as MXFP4 blocks on the GPU (gguf-py's quantizer)."""
    for name in ("gate_proj", "up_proj", "down_proj"):
        values = getattr(moe.experts, name).detach().float().cpu()
        raw = gguf.quants.quantize(values.reshape(-1, values.shape[-1]).numpy(),
                                   gguf.GGMLQuantizationType.MXFP4)
        blocks = torch.from_numpy(raw).view(values.shape[0], values.shape[1], -1).cuda()
        del moe.experts._parameters[name]
        setattr(moe.experts, name, QuantizedExperts(gguf.GGMLQuantizationType.MXFP4,
                                                    tuple(values.shape), blocks, torch.bfloat16))


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """bf16 against the reference's own bf16 rounding order: relative to the output's scale."""
    scale = want.float().abs().max()
    assert (got.float() - want.float()).abs().max() <= 0.03 * scale, (got, want)


@pytest.mark.parametrize("name", ["gpt_oss", "glm4_moe"])
def test_moe_layer_paths_track_the_reference(name: str) -> None:
    from strata.engine.core.fast.batch_experts import experts_rows
    from strata.engine.core.fast.moe_grouped import moe_forward

    config = GPT_OSS_20B if name == "gpt_oss" else GLM_AIR_LIKE
    model = build_random_model(config, "cuda", torch.bfloat16, seed=0, std=0.02)
    moe = model.model.layers[-1].mlp
    if name == "gpt_oss":
        _mxfp4(moe)
    g = torch.Generator(device="cuda").manual_seed(1)
    x = {rows: torch.randn(rows, config.hidden_size, generator=g, device="cuda",
                           dtype=torch.bfloat16) for rows in (1, 4, 300)}
    with torch.inference_mode():
        for rows, v in x.items():
            want = moe(v)
            got = experts_rows(moe, v) if rows == 4 else moe_forward(moe, v, "triton")
            _close(got, want)
        # One token replayed from a CUDA graph: no host sync inside, same answer.
        one = x[1].clone()
        moe_forward(moe, one, "triton")  # compiles and tunes before the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = moe_forward(moe, one, "triton")
        one.copy_(x[1] * 0.5)
        graph.replay()
        _close(out, moe(one))


def test_glm_in_groups_routes_by_the_module_in_a_graph() -> None:
    """n_group > 1 (no shipped GLM uses it) takes the module's own routing: capturable too."""
    from strata.engine.core.fast.moe_grouped import moe_forward, router_kind

    config = dataclasses.replace(GLM_AIR_LIKE, n_group=8, topk_group=4)
    model = build_random_model(config, "cuda", torch.bfloat16, seed=0, std=0.02)
    moe = model.model.layers[-1].mlp
    assert router_kind(moe) is None
    one = torch.randn(1, config.hidden_size, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        moe_forward(moe, one, "triton")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = moe_forward(moe, one, "triton")
        graph.replay()
        _close(out, moe(one))


@pytest.fixture(scope="module")
def gpt_oss_mxfp4_moe():
    """gpt-oss-20b's MoE layer with MXFP4 experts, quantized once (gguf-py takes a while)."""
    model = build_random_model(GPT_OSS_20B, "cuda", torch.bfloat16, seed=0, std=0.02)
    moe = model.model.layers[-1].mlp
    _mxfp4(moe)
    return moe


@pytest.mark.parametrize("tiles", [(16, 16, 256, False), (16, 16, 256, True),
                                   (4, 4, 512, True), (8, 2, 256, True), None])
def test_mxfp4_tile_choices_match_the_dequantized_experts(gpt_oss_mxfp4_moe, tiles) -> None:
    """Every tile shape bench/diag_mxfp4_gemv.py times, the block reader and the generic
    decoder, gives gpt-oss-20b's one-token MoE of its dequantized experts (K = 90 blocks:
    the last step of 8 or 16 blocks is cut by the mask); None: the autotuned launch."""
    from strata.engine.core.fast import expert_epilogue
    from strata.engine.core.quant import expert_tile_gemv

    moe = gpt_oss_mxfp4_moe
    epilogue = expert_epilogue.of(moe)
    stacks = [getattr(moe.experts, name) for name in ("gate_proj", "up_proj", "down_proj")]

    def dequantized(stack, expert: int) -> torch.Tensor:
        blocks = stack.raw[expert].cpu().numpy()
        return torch.from_numpy(gguf.quants.dequantize(blocks, stack.qtype)).cuda()

    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(2880, generator=g, device="cuda", dtype=torch.bfloat16)
    ids = torch.tensor([31, 0, 7, 18], device="cuda")
    weights = torch.tensor([0.4, 0.3, 0.2, 0.1], device="cuda")
    want = torch.zeros(2880, device="cuda")
    for j, e in enumerate(ids.tolist()):
        gate_w, up_w, down_w = (dequantized(stack, e) for stack in stacks)
        gate = gate_w @ x.float() + epilogue.gate_bias[e].float()
        up = up_w @ x.float() + epilogue.up_bias[e].float()
        act = epilogue.activate(gate, up).to(torch.bfloat16).float()  # stored in bf16
        want += weights[j] * (down_w @ act + epilogue.down_bias[e].float())
    got = expert_tile_gemv.routed_mlp(x, *stacks, ids, weights, epilogue=epilogue,
                                      tiles=tiles and expert_tile_gemv.Tiles(*tiles))
    _close(got, want)
