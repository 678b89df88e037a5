"""Time of one Qwen3-30B-A3B-shaped MoE layer over quantized experts on the GPU (issue 19),
against the same layer over bf16 experts: one token (router, routed experts dequantized by
the gather kernel, grouped kernels) and a prefill chunk (each projection of all experts
dequantized into the scratch, grouped GEMMs), per GGML type.

Prints one row per (type, tokens) with microseconds and the bytes of blocks the step must
read, then the JSON. The quantized decode here dequantizes into a scratch (writes and reads
k experts in bf16 again); the fused kernel that would read only the blocks is the next step,
and this bench is its baseline.

    python bench/diag_quant_experts.py [--types Q4_K,Q6_K,Q8_0,IQ2_XXS,IQ3_S] [--experts 128]
"""

from __future__ import annotations

import argparse
import json

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from limits import time_s  # bench/limits.py, next to this file


def _time_us(fn, repeats: int) -> float:
    return time_s(fn, repeats) * 1e6  # limits.py: CUDA events after one warm-up


def _random_experts(qtype, num_experts: int, rows: int, cols: int):
    from strata.engine.core.quant.experts import QuantizedExperts

    block_size, block_bytes = GGML_QUANT_SIZES[qtype]
    blocks = torch.randint(0, 256, (num_experts, rows, cols // block_size * block_bytes),
                           dtype=torch.uint8, device="cuda")
    blocks &= 0x3F  # small bytes everywhere: every fp16 scale finite (diag_quant_gemv.py)
    return QuantizedExperts(qtype, (num_experts, rows, cols), blocks, torch.bfloat16)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", default="Q4_K,Q6_K,Q8_0,IQ2_XXS,IQ3_S")
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inter", type=int, default=768)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--prefill-tokens", type=int, default=512)
    args = parser.parse_args()
    from strata.engine.core.fast.moe_grouped import experts_triton
    from strata.engine.core.fast.moe_prefill import moe_block
    from strata.engine.core.models.switch import SparseMoE
    from strata.engine.core.quant.weight import reserve_scratch

    e, h, i = args.experts, args.hidden, args.inter
    moe = SparseMoE(h, i, e, args.top_k, True).cuda().bfloat16()
    reserve_scratch(torch.device("cuda"), torch.bfloat16, e * h * i)
    float_stacks = (moe.experts.gate_proj, moe.experts.up_proj, moe.experts.down_proj)
    rows = []

    def measure(label: str, read_bytes: int) -> None:
        for tokens in (1, args.prefill_tokens):
            x = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16)
            step = (lambda x=x: experts_triton(moe, x)) if tokens == 1 else (
                lambda x=x: moe_block(moe, x))
            us = _time_us(step, repeats=20 if tokens > 1 else 100)
            rows.append({"experts": label, "tokens": tokens, "us": round(us, 2),
                         "expert_bytes_read": read_bytes if tokens == 1 else read_bytes * e
                         // args.top_k})
            print(rows[-1])

    measure("bf16", 3 * args.top_k * h * i * 2)
    for type_name in args.types.split(","):
        qtype = GGMLQuantizationType[type_name]
        stacks = [_random_experts(qtype, e, i, h), _random_experts(qtype, e, i, h),
                  _random_experts(qtype, e, h, i)]
        for name, stack in zip(("gate_proj", "up_proj", "down_proj"), stacks):
            del moe.experts._parameters[name]
            setattr(moe.experts, name, stack)
        measure(type_name, sum(s.nbytes for s in stacks) * args.top_k // e)
        for name, param in zip(("gate_proj", "up_proj", "down_proj"), float_stacks):
            delattr(moe.experts, name)
            moe.experts.register_parameter(name, param)
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "shape": {"experts": e, "hidden": h, "inter": i, "top_k": args.top_k},
                      "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
