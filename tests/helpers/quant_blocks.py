"""GGML blocks for kernel tests: random valid blocks of any type, or gguf-py's own quantization.

Random bytes are valid blocks of every type Strata has a kernel for, as long as the fp16
fields (d, dmin, m) are finite: so the bytes are random and those fields overwritten with
random finite halves of both signs.
"""

from __future__ import annotations

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

# Byte offsets of the fp16 fields inside each block (ggml-common.h's block structs).
HALF_OFFSETS = {
    QT.Q4_0: (0,), QT.Q4_1: (0, 2), QT.Q5_0: (0,), QT.Q5_1: (0, 2), QT.Q8_0: (0,),
    QT.Q2_K: (80, 82), QT.Q3_K: (108,), QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (208,),
    QT.IQ4_NL: (0,), QT.IQ4_XS: (0,),
    QT.IQ2_XXS: (0,), QT.IQ2_XS: (0,), QT.IQ2_S: (0,), QT.IQ3_XXS: (0,), QT.IQ3_S: (0,),
    QT.IQ1_S: (0,), QT.IQ1_M: (),
    QT.MXFP4: (),
}  # fmt: skip
IQ1_M_SCALES_OFFSET = 48  # IQ1_M's d is the top nibbles of its 4 uint16 scales there


def random_blocks(qtype: QT, rows: int, cols: int, seed: int, scale: float = 1.0) -> np.ndarray:
    """uint8 [rows, row_bytes]: random blocks with finite fp16 fields of about `scale`."""
    block_size, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows, cols // block_size, block_bytes), dtype=np.uint8)
    for offset in HALF_OFFSETS[qtype]:
        halves = (rng.standard_normal(blocks.shape[:2]) * scale).astype(np.float16)
        blocks[:, :, offset : offset + 2] = halves.view(np.uint8).reshape(*blocks.shape[:2], 2)
    if qtype == QT.MXFP4:  # E8M0 exponents near 2**log2(scale): finite products
        center = 127 + int(np.round(np.log2(scale)))
        blocks[:, :, 0] = rng.integers(center - 6, center + 3, size=blocks.shape[:2])
    if qtype == QT.IQ1_M:
        bits = (rng.standard_normal(blocks.shape[:2]) * scale).astype(np.float16).view(np.uint16)
        scales = blocks[:, :, IQ1_M_SCALES_OFFSET:].copy().view(np.uint16)  # [rows, n, 4]
        for i in range(4):
            nibble = ((bits >> (4 * i)) & 15).astype(np.uint16)
            scales[:, :, i] = (scales[:, :, i] & 0x0FFF) | (nibble << 12)
        blocks[:, :, IQ1_M_SCALES_OFFSET:] = scales.view(np.uint8)
    return blocks.reshape(rows, -1)


def gguf_quantized(qtype: QT, rows: int, cols: int, seed: int) -> np.ndarray:
    """Rows of random values at scales from 1e-3 to 1e2 (and one zero row), quantized by
    gguf-py: uint8 [rows, row_bytes]."""
    rng = np.random.default_rng(seed)
    values = rng.standard_normal((rows, cols)).astype(np.float32)
    values *= np.logspace(-3, 2, rows, dtype=np.float32)[:, None]
    values[0] = 0.0
    return gguf.quants.quantize(values, qtype)


def random_experts(qtype: QT, num_experts: int, rows: int, cols: int, seed: int,
                   scale: float = 1.0, device: str = "cuda", dtype=None):
    """QuantizedExperts [num_experts, rows, cols] of random_blocks on `device`; values come
    out in `dtype` (default bfloat16)."""
    import torch

    from strata.engine.core.quant.experts import QuantizedExperts

    raw = torch.from_numpy(random_blocks(qtype, num_experts * rows, cols, seed, scale=scale))
    blocks = raw.view(num_experts, rows, -1).to(device)
    return QuantizedExperts(qtype, (num_experts, rows, cols), blocks, dtype or torch.bfloat16)


# Tiny MoE files whose expert types change per layer, as Q4_K_M's down projections do: the
# expert store then has two slot classes of MIXED_LAYERS // 2 layers (expert_store.py).
MIXED_LAYERS = 4


def alternating_mix(even: tuple[str, str, str], odd: tuple[str, str, str]) -> dict[str, str]:
    """GGUF expert tensor name -> type for MIXED_LAYERS layers: (gate, up, down) types of
    `even` in layers 0, 2, ..., of `odd` in 1, 3, ..."""
    return {f"blk.{layer}.ffn_{proj}_exps.weight": (odd if layer % 2 else even)[p]
            for layer in range(MIXED_LAYERS) for p, proj in enumerate(("gate", "up", "down"))}


# K- and I-quants, gate and up of different types, down's changing per layer (Q4_K_M-like):
# layers 0 and 2 store their experts in one size, 1 and 3 in another.
K_AND_I_MIX = alternating_mix(("IQ2_XXS", "Q4_K", "Q6_K"), ("IQ3_S", "Q4_K", "Q4_K"))


def random_pair(type_a: QT, rows_a: int, type_b: QT, rows_b: int, cols: int, seed: int,
                scale: float, device: str = "cpu"):
    """(blocks a, blocks b, gemv_dp4a.QuantizedPair over both back to back) on device: random
    blocks of two types as fused_views.adjacent_pair finds q/k/v of two types in an arena."""
    import torch

    from strata.engine.core.quant import gemv_dp4a

    raw_a = random_blocks(type_a, rows_a, cols, seed=seed, scale=scale)
    raw_b = random_blocks(type_b, rows_b, cols, seed=seed + 1, scale=scale)
    both = torch.from_numpy(np.concatenate([raw_a.reshape(-1), raw_b.reshape(-1)])).to(device)
    row_bytes = (raw_a.shape[1], raw_b.shape[1])
    qtypes = (int(type_a), int(type_b))
    assert gemv_dp4a.pair_supported(qtypes, row_bytes, cols, both.data_ptr(), rows_a)
    pair = gemv_dp4a.QuantizedPair(both, qtypes, (rows_a, rows_b), row_bytes, cols)
    return torch.from_numpy(raw_a).to(device), torch.from_numpy(raw_b).to(device), pair


def openai_mxfp4(values):
    """[E, N, K] float tensor -> OpenAI's MXFP4 (blocks uint8 [E, N, K/32, 16], scales uint8
    [E, N, K/32]): gguf-py's quantizer, then the inverse of loader/mxfp4_hf.py's byte shuffle
    (OpenAI: code 2j in byte j's low nibble, 2j + 1 in its high one)."""
    import torch

    num_experts, rows, cols = values.shape
    raw = torch.from_numpy(gguf.quants.quantize(values.float().numpy(), QT.MXFP4))
    raw = raw.view(num_experts, rows, cols // 32, 17)
    scales, packed = raw[..., 0], raw[..., 1:]
    codes = torch.cat((packed & 0x0F, packed >> 4), dim=-1)  # [.., 32] in value order
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous(), scales.contiguous()


def save_experts_as_openai_mxfp4(directory, model) -> None:
    """Rewrite a saved tiny gpt-oss's experts in the original release's MXFP4 form
    (`*_blocks` + `*_scales`), and set `model`'s experts to the values those hold
    (transformers' own MXFP4 dequantizer: the oracle)."""
    from pathlib import Path

    import torch
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import _convert_moe_packed_tensors

    path = Path(directory) / "model.safetensors"
    state = load_file(path)
    params = model.state_dict()
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        # transformers multiplies x @ W, [E, K, N]; the MXFP4 form is [E, N, K]
        blocks, scales = openai_mxfp4(state.pop(name).transpose(1, 2).contiguous())
        state[name + "_blocks"], state[name + "_scales"] = blocks, scales
        with torch.no_grad():
            params[name].copy_(_convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    save_file(state, path)
