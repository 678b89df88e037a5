"""Which GGUF tensors stay quantized on the GPU, and the VRAM a model will hold (torch-free).

Shared by the engine's loader (what to keep as raw blocks) and `strata info` (the host side,
which must not import torch): one list of the types Strata has kernels for, one rule for
which tensors use them, one estimate of the bytes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# GGML types with a Strata kernel (quant/kernels.py): their blocks stay as stored. Every other
# quantized type is dequantized at load, for that tensor alone, with a log line.
KERNEL_QUANT_TYPES = (
    "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
    "IQ4_NL", "IQ4_XS",
    "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M",
    "MXFP4",
)  # fmt: skip
FLOAT_TYPES = ("F32", "F16", "BF16")
COMPUTE_ITEMSIZE_BYTES = 2  # bf16 on a GPU: what a float or dequantized tensor costs
# The grouped MoE prefill's scratch (quant/expert_grouped.py): the dequantized gate and up of
# a group of experts, then their down projections. 192 MiB is 32 of Qwen3-30B-A3B's (6 MiB
# each in bf16), 1% of its 18.6 GB Q4_K_M file; a model whose expert needs more holds one
# expert's at a time. Larger groups mean fewer launches and larger GEMMs; smaller ones did
# not win by staying in L2. Why 32 (bench/diag_dequant.py --scratch-mib, docs/benchmarks.md
# run 23): 18% faster a layer than 16 at 512 tokens, 9% at 4096; all 128 at once would buy
# 7% more for four times the VRAM.
EXPERT_SCRATCH_BYTES = 192 << 20
DEFAULT_MAX_CONTEXT_TOKENS = 8192  # the engine's context when none is configured (capped)

# Tensors a linear layer, the embedding or the expert matmuls read (canonical HF names): they
# may stay quantized. Routers, norms and biases stay float.
_QUANTIZABLE = re.compile(
    r"^(model\.embed_tokens\.weight|lm_head\.weight|"
    r"model\.layers\.\d+\.self_attn\.[qkvo]_proj\.weight|"
    r"model\.layers\.\d+\.mlp\.(shared_experts\.)?(gate|up|down)_proj\.weight|"
    r"model\.layers\.\d+\.mlp\.experts\.(gate|up|down)_proj)$"
)
# A layer's stacked experts in GGUF names: (layer, projection).
_EXPERT_STACK = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$")
# The same in GGUF names, for `strata info` (which reads no config to map names): stacked
# experts (ffn_*_exps) and the per-expert tensors of old Mixtral files (ffn_*.E) included.
_QUANTIZABLE_GGUF = re.compile(
    r"^(token_embd|output|blk\.\d+\.(attn_[qkv]|attn_qkv|attn_output|ffn_gate|ffn_up|ffn_down|"
    r"ffn_(gate|up|down)_shexp|"
    r"ffn_(gate|up|down)_exps|ffn_(gate|up|down)\.\d+))\.weight$"
)


def is_quantizable(canonical_name: str) -> bool:
    """Whether a canonical tensor is read only through qlinear / the quantized embedding."""
    return _QUANTIZABLE.match(canonical_name) is not None


def has_kernel(type_name: str, num_cols: int) -> bool:
    """Whether the kernels read rows of num_cols values of this type as blocks: a kernel type
    whose rows fill whole even byte counts (the kernels read every type's fp16 fields at even
    offsets; MXFP4's blocks are 17 bytes, so its rows need an even number of them)."""
    if type_name not in KERNEL_QUANT_TYPES:
        return False
    return type_name != "MXFP4" or (num_cols // 32) % 2 == 0


def keeps_blocks(gguf_name: str, type_name: str) -> bool:
    """Whether a GGUF tensor of this type stays in its blocks on the GPU."""
    return type_name in KERNEL_QUANT_TYPES and _QUANTIZABLE_GGUF.match(gguf_name) is not None


@dataclass(frozen=True)
class VramEstimate:
    """What a model will hold on a GPU once loaded, in bytes."""

    weights_bytes: int  # as stored for kept blocks, bf16 for the rest
    kv_bytes: int  # one cache slot filled to the configured context (others map as they grow)
    # The prefill's dequantization scratch: the largest matrix, or a group of a layer's
    # experts' dequantized projections (experts_per_group), whichever is larger.
    workspace_bytes: int
    quantized_tensors: int  # how many tensors stay in their blocks
    dequantized_tensors: int  # quantized in the file, dequantized at load (no kernel)

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes + self.workspace_bytes


def experts_per_group(num_experts: int, per_expert_values: int, itemsize: int,
                      scratch_bytes: int = EXPERT_SCRATCH_BYTES) -> int:
    """How many experts' dequantized projections (per_expert_values each: gate and up
    together, or down if larger) a scratch of scratch_bytes holds at once (at least one)."""
    return max(1, min(num_experts, scratch_bytes // (per_expert_values * itemsize)))


def default_context_tokens(model_context_tokens: int) -> int:
    """The context the engine takes when none is configured: the model's own, capped."""
    if model_context_tokens <= 0:
        return DEFAULT_MAX_CONTEXT_TOKENS
    return min(model_context_tokens, DEFAULT_MAX_CONTEXT_TOKENS)


def kv_bytes(num_layers: int, num_kv_heads: int, head_dim: int, context_tokens: int) -> int:
    """K and V of every layer for context_tokens positions, in bf16."""
    return 2 * num_layers * num_kv_heads * head_dim * context_tokens * COMPUTE_ITEMSIZE_BYTES


def estimate_vram(
    tensors: list[tuple[str, str, int, int, int]], kv_total_bytes: int
) -> VramEstimate:
    """tensors: (gguf name, type name, elements, stored bytes, rows) per tensor; a stacked
    expert tensor's rows are its experts (the outermost of its GGUF dimensions)."""
    weights = workspace = kept = dequantized = 0
    layers: dict[str, dict[str, int]] = {}  # a layer's kept expert stacks: values, experts
    for name, type_name, numel, nbytes, rows in tensors:
        if keeps_blocks(name, type_name):
            weights += nbytes
            kept += 1
            stacked = _EXPERT_STACK.match(name)
            if stacked is not None:
                layer = layers.setdefault(stacked.group(1), {"gate_up": 0, "down": 0})
                layer["down" if stacked.group(2) == "down" else "gate_up"] += numel
                layer["experts"] = rows
            elif not name.startswith(("token_embd", "output")):  # rows, or one token: none
                workspace = max(workspace, numel * COMPUTE_ITEMSIZE_BYTES)
        else:
            weights += numel * COMPUTE_ITEMSIZE_BYTES
            dequantized += type_name not in FLOAT_TYPES
    for layer in layers.values():  # the grouped prefill's scratch (experts_per_group)
        per_expert = max(layer["gate_up"], layer["down"]) // layer["experts"]
        group = experts_per_group(layer["experts"], per_expert, COMPUTE_ITEMSIZE_BYTES)
        workspace = max(workspace, group * per_expert * COMPUTE_ITEMSIZE_BYTES)
    return VramEstimate(weights, kv_total_bytes, workspace, kept, dequantized)
