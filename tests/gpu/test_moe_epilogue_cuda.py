"""GLM-4.5's and GPT-OSS's MoE layers on the GPU (what the CPU tests check interpreted,
tests/core/test_fast_paths.py): gpt-oss-20b's expert shape (32 experts, top 4, hidden and
width 2880) with MXFP4 experts, biases and the clamped SwiGLU, and a GLM layer with sigmoid
routing and a shared expert, in bf16 through the one-token kernels (in a CUDA graph too), a
batch's rows and the prefill path, against the reference module; the one-token MXFP4
experts both by dp4a (quant/expert_gemv.py, every candidate tile, resident and through a
slot table) and by the float tile decoder, against the dequantized experts. Times nothing."""

from __future__ import annotations

import dataclasses
import itertools

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


def _dequantized_reference(moe, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                           rounds: bool) -> torch.Tensor:
    """The one-token MoE of moe's dequantized MXFP4 experts (float32 on the GPU): x and the
    activations rounded to int8 per 32 (quantize_x) where rounds, as dp4a reads them."""
    from strata.engine.core.fast import expert_epilogue
    from strata.engine.core.quant import gemv_dp4a

    def int8(v: torch.Tensor) -> torch.Tensor:
        if not rounds:
            return v.float()
        q, d, _ = gemv_dp4a.quantize_x(v[None].to(torch.bfloat16))
        return (q.float().view(-1, 32) * d.view(-1, 1)).view(-1)

    epilogue = expert_epilogue.of(moe)
    stacks = [getattr(moe.experts, name) for name in ("gate_proj", "up_proj", "down_proj")]
    want = torch.zeros(x.shape[-1], device="cuda")
    for j, e in enumerate(ids.tolist()):
        gate_w, up_w, down_w = (torch.from_numpy(gguf.quants.dequantize(
            s.raw[e].cpu().numpy(), s.qtype)).cuda() for s in stacks)
        gate = gate_w @ int8(x) + epilogue.gate_bias[e].float()
        up = up_w @ int8(x) + epilogue.up_bias[e].float()
        act = epilogue.activate(gate, up).to(torch.bfloat16)  # stored in bf16
        want += weights[j] * (down_w @ int8(act) + epilogue.down_bias[e].float())
    return want


def test_mxfp4_experts_by_dp4a_match_the_dequantized_experts(gpt_oss_mxfp4_moe,
                                                             monkeypatch) -> None:
    """gpt-oss-20b's MXFP4 experts with bf16 x go by dp4a (expert_gemv: prmt lookups, funnel
    shifts at every byte) with the biases and clamped SwiGLU: every candidate tile of its
    gate/up and down kernels against the dequantized experts times the int8-rounded x and
    activations; through a slot table over a pinned host copy the same sums bit for bit;
    moe_forward takes this path and the norm's rounded x (takes_rounded_x), and the float
    tile decoder stays within int8's cost of it."""
    import triton

    from strata.engine.core.fast import expert_epilogue
    from strata.engine.core.fast.moe_grouped import moe_forward, takes_rounded_x
    from strata.engine.core.quant import expert_gemv, expert_tile_gemv, gemv_dp4a

    moe = gpt_oss_mxfp4_moe
    epilogue = expert_epilogue.of(moe)
    stacks = [getattr(moe.experts, name) for name in ("gate_proj", "up_proj", "down_proj")]
    g = torch.Generator(device="cuda").manual_seed(4)
    x = torch.randn(2880, generator=g, device="cuda", dtype=torch.bfloat16)
    ids = torch.tensor([31, 0, 7, 18], device="cuda")
    weights = torch.tensor([0.4, 0.3, 0.2, 0.1], device="cuda")
    assert expert_gemv.takes(*stacks, x, epilogue=epilogue)
    assert takes_rounded_x(moe, x[None], "triton")
    want = _dequantized_reference(moe, x, ids, weights, rounds=True)

    def config(rows, cols, warps, stages):
        return triton.Config({"BLOCK_ROWS": rows, "BLOCK_COLS": cols, "STAGES": stages},
                             num_warps=warps)

    gate_up_tiles, down_tiles = (expert_gemv.GATE_UP_DP4A_CONFIGS,
                                 expert_gemv.DOWN_SUM_DP4A_CONFIGS)
    for tile_gate_up, tile_down in itertools.zip_longest(gate_up_tiles, down_tiles,
                                                         fillvalue=None):
        tile_gate_up, tile_down = tile_gate_up or gate_up_tiles[0], tile_down or down_tiles[0]
        monkeypatch.setattr(expert_gemv._gate_up_dp4a_tuned, "configs", [config(*tile_gate_up)])
        monkeypatch.setattr(expert_gemv._down_sum_dp4a_tuned, "configs", [config(*tile_down)])
        got = expert_gemv.routed_mlp(x, *stacks, ids, weights, epilogue=epilogue)
        _close(got, want)
    monkeypatch.undo()
    resident = expert_gemv.routed_mlp(x, *stacks, ids, weights, epilogue=epilogue)
    # A partial cache: experts 31 and 7 in slots, the rest read in place from pinned memory.
    placed = {31: 1, 7: 0}
    table = torch.full((32,), -1, dtype=torch.int32)
    slots, offsets, hosts = [], [], []
    for stack in stacks:
        host = stack.raw.cpu().pin_memory()
        hosts.append(host)  # alive while the kernels read it
        stride = stack.expert_stride
        slot_rows = torch.zeros(3, stride, dtype=torch.uint8, device="cuda")
        for expert, slot in placed.items():
            slot_rows[slot] = stack.raw[expert].reshape(-1)
        _, rows, row_bytes = stack.raw.shape
        slots.append(QuantizedExperts(stack.qtype, (3, *stack.shape[1:]), slot_rows.as_strided(
            (3, rows, row_bytes), (stride, row_bytes, 1)), torch.bfloat16))
        offsets.append(host.data_ptr() - slot_rows.data_ptr())
    for expert, slot in placed.items():
        table[expert] = slot
    table = table.cuda()
    assert expert_gemv.takes(*slots, x, table, tuple(offsets), epilogue)
    got = expert_gemv.routed_mlp(x, *slots, ids, weights, table, tuple(offsets),
                                 epilogue=epilogue)
    torch.testing.assert_close(got, resident, rtol=0, atol=0)
    with torch.inference_mode():  # the layer's own routing: this path, rounded x or not
        one = x[None]
        plain = moe_forward(moe, one, "triton")
        rounded = moe_forward(moe, one, "triton", rounded=gemv_dp4a.quantize_x(one))
        torch.testing.assert_close(rounded, plain, rtol=0, atol=0)
        _close(plain, moe(one))
    tile = expert_tile_gemv.routed_mlp(x, *stacks, ids, weights, epilogue=epilogue)
    _close(tile, _dequantized_reference(moe, x, ids, weights, rounds=False))
    _close(resident, tile.float())  # int8 x costs within bf16's reach of the float path
