"""Which GGML type each tensor of a random GGUF gets, as llama.cpp's llama-quantize picks it.

The rule is read from llama.cpp's src/llama-quant.cpp (`llama_tensor_get_type_impl` and
`tensor_type_fallback`, commit 0c1e570), for the mixes the peer benchmarks use (issues 19 and
52): Q4_K_M, Q8_0, IQ2_XXS (a low-bit MoE file), MXFP4_MOE (gpt-oss: 3-D expert tensors
MXFP4, every other matrix Q8_0), the unquantized F16/BF16, and Q4_0_QAT, which is not a
llama-quantize mix but the layout of Google's Gemma 3 QAT files (see tensor_type). Only the
branches these mixes and the supported architectures reach are kept; the 70B-only and
Falcon-only branches are left out. Tensors llama-quantize never touches stay F32: 1-D ones,
norms, biases (gpt-oss's 2-D expert biases too: only names ending in "weight" are
quantized) and the MoE router (ffn_gate_inp).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import gguf
from gguf import GGMLQuantizationType as QT

# general.file_type (llama_ftype) of each mix, and its default type for a matrix.
FILE_TYPES = {"F16": 1, "BF16": 32, "Q8_0": 7, "Q4_K_M": 15, "IQ2_XXS": 19, "MXFP4_MOE": 38,
              "Q4_0_QAT": 2}
DEFAULT_TYPES = {"F16": QT.F16, "BF16": QT.BF16, "Q8_0": QT.Q8_0, "Q4_K_M": QT.Q4_K,
                 "IQ2_XXS": QT.IQ2_XXS, "MXFP4_MOE": QT.Q8_0, "Q4_0_QAT": QT.Q4_0}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.")
# tensor_type_fallback: a row that is not whole blocks of the chosen type takes this one.
_FALLBACK = {QT.IQ2_XXS: QT.IQ4_NL, QT.Q2_K: QT.Q4_0, QT.Q3_K: QT.Q4_0, QT.Q4_K: QT.Q5_0,
             QT.Q5_K: QT.Q5_1, QT.Q6_K: QT.Q8_0}


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
    """Tensors llama-quantize never quantizes: 1-D ones, those not named *weight (biases),
    norms, the MoE router."""
    return (ndim < 2 or not name.endswith("weight") or name.endswith("_norm.weight")
            or "ffn_gate_inp.weight" in name)


def fallback(qtype: QT, cols: int) -> QT:
    """llama-quant.cpp's tensor_type_fallback: the type a row of `cols` values gets when it
    is not whole blocks of `qtype` (GLM-4.5's 10944- and 1408-wide down projections)."""
    block_size = gguf.GGML_QUANT_SIZES[qtype][0]
    if cols % block_size == 0:
        return qtype
    other = _FALLBACK.get(qtype, qtype)
    return other if cols % gguf.GGML_QUANT_SIZES[other][0] == 0 else QT.F16


def tensor_type(mix: str, name: str, dims: tuple[int, ...], shape: ModelShape) -> QT:
    """The GGML type of tensor `name` (GGUF name, `dims` in numpy order) in a file of `mix`."""
    if mix not in DEFAULT_TYPES:
        raise ValueError(f"unknown mix {mix!r}: use one of {', '.join(DEFAULT_TYPES)}")
    if stays_float(name, len(dims)):
        return QT.F32
    if mix in ("F16", "BF16"):
        return DEFAULT_TYPES[mix]
    return fallback(_quantized_type(mix, name, dims, shape), dims[-1])


def _quantized_type(mix: str, name: str, dims: tuple[int, ...], shape: ModelShape) -> QT:
    default = DEFAULT_TYPES[mix]
    is_head = name == "output.weight" or (name == "token_embd.weight" and shape.is_tied)
    if mix == "Q4_0_QAT":
        # Google's gemma-3-*-it-qat-q4_0 files (an assumption from their sizes: 17.2 GB for
        # the 27B is Q4_0 matrices plus an F16 embedding): the tied token embedding is
        # F16, every other matrix Q4_0. llama-quantize's Q4_0 would make the head Q6_K.
        return QT.F16 if name == "token_embd.weight" else default
    match = _LAYER_RE.match(name)
    layer = int(match.group(1)) if match else -1
    is_mixtral = shape.num_experts == 8  # llama.cpp special-cases 8-expert models
    if is_head:
        if mix == "MXFP4_MOE" or dims[-1] % gguf.GGML_QUANT_SIZES[default][0]:
            return QT.Q8_0
        if mix == "IQ2_XXS":
            return QT.Q5_K
        return default if default == QT.Q8_0 else QT.Q6_K
    if mix == "MXFP4_MOE":  # expert tensors (3-D) MXFP4, every other matrix Q8_0
        return QT.MXFP4 if len(dims) == 3 else QT.Q8_0
    if name == "token_embd.weight":
        return QT.Q2_K if mix == "IQ2_XXS" else default
    # attn_v, and phi3's fused attn_qkv: llama.cpp's category_is_attn_v; one per layer here.
    is_attn_v = "attn_v.weight" in name or "attn_qkv.weight" in name
    if mix == "IQ2_XXS":
        if is_attn_v:
            return QT.Q4_K if shape.gqa >= 4 or shape.num_experts >= 4 else QT.Q2_K
        if is_mixtral and "attn_k.weight" in name:
            return QT.Q4_K
        if "ffn_down" in name:  # counts ffn_down tensors: one per layer here
            return QT.Q2_K if layer < shape.num_layers // 8 else default
        if is_mixtral and "attn_output.weight" in name:
            return QT.Q5_K
        return default
    if is_attn_v:
        if is_mixtral:
            return QT.Q8_0
        if mix == "Q4_K_M" and use_more_bits(layer, shape.num_layers):
            return QT.Q6_K
        return default
    if "attn_k.weight" in name and is_mixtral:
        return QT.Q8_0
    # Every ffn_down* (dense, experts, shared expert) is one category, by its layer.
    if "ffn_down" in name and mix == "Q4_K_M" and use_more_bits(layer, shape.num_layers):
        return QT.Q6_K
    if "attn_output.weight" in name and is_mixtral and mix == "Q4_K_M":
        return QT.Q5_K
    return default
