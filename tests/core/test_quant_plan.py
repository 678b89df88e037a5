"""Which tensors keep their GGML blocks, and the VRAM `strata info` says a model will hold."""

from __future__ import annotations

import gguf
import pytest
import torch

from strata.engine.core.loader import inspect_model
from strata.engine.core.loader.quant_plan import (
    EXPERT_SCRATCH_BYTES,
    estimate_vram,
    experts_per_group,
    is_quantizable,
    keeps_blocks,
    kv_bytes,
)
from strata.engine.core.model_info import format_model_info
from tests.helpers.gguf_writer import write_gguf_from_hf
from tests.helpers.tiny_models import make_tiny_hf_config


@pytest.mark.parametrize(("name", "expected"), [
    ("model.layers.3.self_attn.q_proj.weight", True),
    ("model.layers.3.self_attn.o_proj.weight", True),
    ("model.layers.0.mlp.down_proj.weight", True),
    ("model.embed_tokens.weight", True),
    ("lm_head.weight", True),
    ("model.layers.0.mlp.experts.gate_proj", True),  # dequantized per step (quant/experts.py)
    ("model.layers.0.mlp.router.weight", False),
    ("model.layers.1.mlp.shared_experts.up_proj.weight", True),  # GLM's shared expert
    ("model.layers.1.mlp.e_score_correction_bias", False),
    ("model.layers.0.self_attn.q_proj.bias", False),
    ("model.norm.weight", False),
])
def test_which_canonical_tensors_may_stay_quantized(name: str, expected: bool) -> None:
    assert is_quantizable(name) is expected


def test_gguf_names_follow_the_same_rule() -> None:
    assert keeps_blocks("blk.0.attn_v.weight", "Q6_K")
    assert keeps_blocks("token_embd.weight", "Q8_0")
    assert keeps_blocks("blk.0.ffn_gate_exps.weight", "Q4_K")
    assert keeps_blocks("blk.0.ffn_down.3.weight", "Q4_0")  # old per-expert Mixtral files
    assert keeps_blocks("blk.1.ffn_down_shexp.weight", "Q4_K")  # GLM's shared expert
    assert not keeps_blocks("blk.0.attn_norm.weight", "F32")
    assert keeps_blocks("blk.0.attn_q.weight", "IQ2_XXS")
    assert not keeps_blocks("blk.0.attn_q.weight", "TQ2_0")  # no kernel: dequantized


def test_info_shows_the_vram_a_quantized_file_will_hold(tmp_path) -> None:
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(make_tiny_hf_config("llama"))
    path = write_gguf_from_hf(model, None, tmp_path / "m.gguf", "Q8_0")
    reader = gguf.GGUFReader(str(path))
    blocks = sum(int(t.n_bytes) for t in reader.tensors if t.tensor_type.name == "Q8_0")
    floats = sum(int(t.n_elements) for t in reader.tensors if t.tensor_type.name == "F32")
    info = inspect_model(path, context_tokens=128)
    vram = info.vram
    assert vram.quantized_tensors == 16 and vram.dequantized_tensors == 0
    assert vram.weights_bytes == blocks + 2 * floats  # blocks as stored, norms in bf16
    assert vram.kv_bytes == kv_bytes(2, 2, 16, 128) == 2 * 2 * 2 * 16 * 128 * 2
    assert vram.workspace_bytes == 96 * 64 * 2  # the largest layer matrix, bf16
    assert vram.total_bytes == vram.weights_bytes + vram.kv_bytes + vram.workspace_bytes
    text = format_model_info(info)
    assert "VRAM on a GPU:" in text and "16 tensors kept in GGML blocks" in text
    assert "at 128 tokens" in text
    # Without a context: the engine's default, the model's own (256) under the 8192 cap.
    assert inspect_model(path).vram_context_tokens == 256


def test_info_counts_quantized_experts_as_stored(tmp_path) -> None:
    """Stacked experts stay in their blocks on a GPU: stored bytes, and the workspace holds
    a group of a layer's experts' gate and up dequantized (the grouped prefill's scratch:
    all 8 of this tiny model's fit one group)."""
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(make_tiny_hf_config("qwen3_moe"))
    path = write_gguf_from_hf(model, None, tmp_path / "moe.gguf", "Q8_0")
    reader = gguf.GGUFReader(str(path))
    experts = [t for t in reader.tensors if "_exps." in t.name]
    assert len(experts) == 6 and all(t.tensor_type.name == "Q8_0" for t in experts)
    assert all(keeps_blocks(t.name, "Q8_0") for t in experts)
    vram = inspect_model(path, context_tokens=128).vram
    expected = sum(int(t.n_bytes) if keeps_blocks(t.name, t.tensor_type.name)
                   else int(t.n_elements) * 2 for t in reader.tensors)
    assert vram.weights_bytes == expected
    assert vram.workspace_bytes == 8 * 2 * 32 * 64 * 2  # [E, 2I, H] gate and up, bf16


def test_the_expert_workspace_is_the_grouped_prefills_scratch_at_qwen3_30b_a3b_shape() -> None:
    """48 layers of 128 Q4_K_M experts (gate and up [768, 2048], down [2048, 768]): 32
    experts' gate and up fit the 192 MiB scratch, which is the workspace, as the engine
    reserves it (quant/expert_grouped.scratch_numel), not a whole projection's 384 MiB."""
    experts, inter, hidden = 128, 768, 2048
    numel = experts * inter * hidden
    tensors = [(f"blk.{i}.ffn_{p}_exps.weight", q, numel, numel * 9 // 16, experts)
               for i in range(48) for p, q in (("gate", "Q4_K"), ("up", "Q4_K"),
                                               ("down", "Q6_K"))]
    tensors.append(("blk.0.attn_q.weight", "Q4_K", 4096 * hidden, 4096 * hidden // 2, 4096))
    vram = estimate_vram(tensors, 0)
    assert experts_per_group(experts, 2 * inter * hidden, 2) == 32
    assert vram.workspace_bytes == EXPERT_SCRATCH_BYTES == 32 * 2 * inter * hidden * 2
    # A model whose one expert outgrows the scratch still holds one expert's at a time.
    assert experts_per_group(8, EXPERT_SCRATCH_BYTES, 2) == 1
