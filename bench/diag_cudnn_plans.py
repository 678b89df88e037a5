"""What a new sequence length costs each SDPA kernel on its first call: a prefill diagnostic.

    python bench/diag_cudnn_plans.py

Prints milliseconds per call (synchronized, wall clock) of causal GQA attention (32 query /
8 kv heads, head size 128, bf16) for lengths 4096, 4096, 4000, 4000, 1234, 1234, 77, 77:
each length's first call pays what the kernel builds for a new shape, the second does not.
cuDNN builds an execution plan per shape (45-75 ms on an H200); flash builds nothing.
"""

import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def call_ms(backend, num_tokens: int) -> float:
    q = torch.randn(1, 32, num_tokens, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 8, num_tokens, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    torch.cuda.synchronize()
    started_s = time.perf_counter()
    with sdpa_kernel([backend]):
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.cuda.synchronize()
    return (time.perf_counter() - started_s) * 1e3


if __name__ == "__main__":
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION),
                          ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        lengths = (4096, 4096, 4000, 4000, 1234, 1234, 77, 77)
        print(name, [round(call_ms(backend, n), 2) for n in lengths], flush=True)
