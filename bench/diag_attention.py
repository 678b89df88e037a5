"""Which SDPA kernel runs prefill attention fastest on this GPU: a diagnostic for prefill speed.

    python bench/diag_attention.py --json diag-attention.json

Times flash, cuDNN and memory-efficient attention on the prefill shapes of the speed bench
(Llama-3-8B: 32 query / 8 kv heads; Qwen3-30B-A3B: 32 / 4; head size 128, bf16): a first
4096-token chunk (causal) and a second one over 8192 keys (causal aligned bottom-right), with
GQA passed to the kernel (enable_gqa) and, where a kernel refuses that, K/V repeated first.
Each result is checked against the flash output.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

sys.path.insert(0, str(Path(__file__).resolve().parent))  # next to this file
from limits import time_s
from report import write_json  # bench/report.py, next to this file

SHAPES = {"llama3-8b": (32, 8), "qwen3-30b-a3b": (32, 4)}
HEAD_DIM = 128
BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def attend(backend, q, k, v, num_tokens: int, num_keys: int, gqa: bool):
    group = q.shape[1] // k.shape[1]
    if not gqa and group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    mask = None if num_tokens == num_keys else causal_lower_right(num_tokens, num_keys)
    with sdpa_kernel([backend]):
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=gqa and group > 1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the table here")
    args = parser.parse_args()
    rows = []
    for model, (num_heads, num_kv_heads) in SHAPES.items():
        for num_tokens, num_keys in ((4096, 4096), (4096, 8192)):
            q = torch.randn(1, num_heads, num_tokens, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
            # The engine's keys are a transposed view of the [S, Hkv, D] cache: keep that stride.
            k = torch.randn(num_keys, num_kv_heads, HEAD_DIM, device="cuda",
                            dtype=torch.bfloat16).transpose(0, 1)[None]
            v = torch.randn_like(k)
            reference = attend(BACKENDS["flash"], q, k, v, num_tokens, num_keys, True).float()
            # Causal FLOPs: QK^T and PV over the keys each query sees.
            flop = 4 * num_heads * HEAD_DIM * (num_tokens * num_keys - num_tokens ** 2 / 2)
            for name, backend in BACKENDS.items():
                for gqa in (True, False):
                    row = {"model": model, "tokens": num_tokens, "keys": num_keys,
                           "backend": name, "gqa_in_kernel": gqa}
                    try:
                        out = attend(backend, q, k, v, num_tokens, num_keys, gqa)
                        args = (backend, q, k, v, num_tokens, num_keys, gqa)
                        ms = 1e3 * time_s(lambda args=args: attend(*args), 10)
                        row |= {"ms": ms, "tflop_s": flop / ms / 1e9,
                                "max_abs_error": (out.float() - reference).abs().max().item()}
                    except RuntimeError as exc:
                        row["error"] = str(exc).splitlines()[0][:160]
                    rows.append(row)
                    print(json.dumps(row))
    write_json(rows, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
