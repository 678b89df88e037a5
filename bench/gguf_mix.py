"""Which GGML type each tensor of a random GGUF gets, as llama.cpp's llama-quantize picks it.

The rule is read from llama.cpp's src/llama-quant.cpp (`llama_tensor_get_type_impl`), for the
mixes the peer benchmarks use (issue 19): Q4_K_M, Q8_0, IQ2_XXS (a low-bit MoE file), and the
unquantized F16/BF16. Only the branches these mixes and the llama/qwen3moe shapes reach are
kept; the 70B-only and Falcon-only branches are left out. Norms, biases and the MoE router
(ffn_gate_inp) stay F32, as llama-quantize leaves them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gguf import GGMLQuantizationType as QT

# general.file_type (llama_ftype) of each mix, and its default type for a matrix.
FILE_TYPES = {"F16": 1, "BF16": 32, "Q8_0": 7, "Q4_K_M": 15, "IQ2_XXS": 19}
DEFAULT_TYPES = {"F16": QT.F16, "BF16": QT.BF16, "Q8_0": QT.Q8_0, "Q4_K_M": QT.Q4_K,
                 "IQ2_XXS": QT.IQ2_XXS}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.")


@dataclass(frozen=True)
class ModelShape:
    """What the rule reads of the model: layers, experts (0: dense), GQA ratio, and whether
    the output head is the token embedding (then that gets the head's type)."""

    num_layers: int
    num_experts: int
    gqa: int
    is_tied: bool = False


def use_more_bits(layer: int, num_layers: int) -> bool:
    """llama-quant.cpp's use_more_bits: the first and last eighth, and every third between."""
    return (layer < num_layers // 8 or layer >= 7 * num_layers // 8
            or (layer - num_layers // 8) % 3 == 2)


def stays_float(name: str, ndim: int) -> bool:
    """Tensors llama-quantize never quantizes: 1-D ones, norms, the MoE router."""
    return ndim < 2 or name.endswith("_norm.weight") or "ffn_gate_inp.weight" in name


def tensor_type(mix: str, name: str, ndim: int, shape: ModelShape) -> QT:
    """The GGML type of tensor `name` (GGUF name) in a file of `mix`."""
    if mix not in DEFAULT_TYPES:
        raise ValueError(f"unknown mix {mix!r}: use one of {', '.join(DEFAULT_TYPES)}")
    if stays_float(name, ndim):
        return QT.F32
    default = DEFAULT_TYPES[mix]
    if mix in ("F16", "BF16"):
        return default
    match = _LAYER_RE.match(name)
    layer = int(match.group(1)) if match else -1
    is_mixtral = shape.num_experts == 8  # llama.cpp special-cases 8-expert models
    if name == "output.weight" or (name == "token_embd.weight" and shape.is_tied):
        if mix == "IQ2_XXS":
            return QT.Q5_K
        return default if default == QT.Q8_0 else QT.Q6_K
    if name == "token_embd.weight":
        return QT.Q2_K if mix == "IQ2_XXS" else default
    if mix == "IQ2_XXS":
        if "attn_v.weight" in name:
            return QT.Q4_K if shape.gqa >= 4 or shape.num_experts >= 4 else QT.Q2_K
        if is_mixtral and "attn_k.weight" in name:
            return QT.Q4_K
        if "ffn_down" in name:  # counts ffn_down tensors: one per layer here
            return QT.Q2_K if layer < shape.num_layers // 8 else default
        if is_mixtral and "attn_output.weight" in name:
            return QT.Q5_K
        return default
    if "attn_v.weight" in name:
        if is_mixtral:
            return QT.Q8_0
        if mix == "Q4_K_M" and use_more_bits(layer, shape.num_layers):
            return QT.Q6_K
        return default
    if "attn_k.weight" in name and is_mixtral:
        return QT.Q8_0
    if "ffn_down" in name and mix == "Q4_K_M" and use_more_bits(layer, shape.num_layers):
        return QT.Q6_K
    if "attn_output.weight" in name and is_mixtral and mix == "Q4_K_M":
        return QT.Q5_K
    return default
