"""OpenAI's MXFP4 expert tensors (`*_blocks` + `*_scales`, gpt-oss's original safetensors) as
GGML MXFP4 blocks, so they load like a GGUF's experts: kept as blocks where the device keeps
quantized weights, dequantized otherwise.

The two formats hold the same numbers: 32 values a block, each a 4-bit E2M1 code, and one E8M0
exponent byte. They differ in byte order only: OpenAI puts code 2j in byte j's low nibble and
code 2j+1 in its high nibble; GGML puts code j in byte j's low nibble and code j+16 in its high
one, and writes the exponent byte first (17 bytes a block).
"""

from __future__ import annotations

import re

import torch
from gguf import GGMLQuantizationType

from strata.engine.core.loader.lazy import BlockTensor, LazyTensor
from strata.engine.core.model_config import ModelFormatError

_BLOCKS = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)_blocks$")


def openai_to_ggml(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """uint8 blocks [..., n, 16] and scales [..., n] -> GGML MXFP4 rows [..., n * 17]."""
    low, high = blocks & 0x0F, blocks >> 4
    codes = torch.stack((low, high), dim=-1).flatten(-2)  # [..., n, 32] in value order
    packed = codes[..., :16] | (codes[..., 16:] << 4)  # [..., n, 16]
    out = torch.cat((scales[..., None], packed), dim=-1)  # [..., n, 17]
    return out.flatten(-2)


def _ggml_experts(blocks: LazyTensor, scales: LazyTensor, rows: slice | None) -> BlockTensor:
    """An expert stack [E, N, K] of GGML MXFP4 from OpenAI's blocks, optionally rows 0::2
    or 1::2 of N (gate and up interleave there)."""
    num_experts, num_rows, num_blocks, _ = blocks.shape
    if rows is not None:
        num_rows //= 2

    def make_blocks() -> torch.Tensor:
        b, s = blocks.read(), scales.read()
        if rows is not None:
            b, s = b[:, rows], s[:, rows]
        return openai_to_ggml(b, s).contiguous()

    return BlockTensor((num_experts, num_rows, num_blocks * 32), GGMLQuantizationType.MXFP4,
                       make_blocks)


def gather_mxfp4_experts(tensors: dict[str, LazyTensor]) -> dict[str, LazyTensor]:
    """Replace each `experts.{gate_up,down}_proj_blocks` + `_scales` pair by canonical GGML MXFP4
    stacks: gate_proj/up_proj [E, I, H] (rows 0::2 and 1::2 of gate_up), down_proj [E, H, I]."""
    for name in [n for n in tensors if _BLOCKS.match(n)]:
        prefix, kind = _BLOCKS.match(name).groups()  # type: ignore[union-attr]
        blocks = tensors.pop(name)
        scales = tensors.pop(f"{prefix}.{kind}_scales", None)
        if scales is None:
            raise ModelFormatError(f"missing tensor {prefix}.{kind}_scales: the MXFP4 "
                                   "checkpoint is incomplete; download it again")
        if (len(blocks.shape) != 4 or blocks.shape[-1] != 16
                or tuple(scales.shape) != tuple(blocks.shape[:3])):
            raise ModelFormatError(
                f"tensor {name} {tuple(blocks.shape)} and its scales {tuple(scales.shape)} are "
                "not MXFP4 blocks [E, N, K/32, 16] and scales [E, N, K/32]: the file is damaged")
        if kind == "down_proj":
            tensors[f"{prefix}.down_proj"] = _ggml_experts(blocks, scales, None)
        else:
            tensors[f"{prefix}.gate_proj"] = _ggml_experts(blocks, scales, slice(0, None, 2))
            tensors[f"{prefix}.up_proj"] = _ggml_experts(blocks, scales, slice(1, None, 2))
    return tensors
