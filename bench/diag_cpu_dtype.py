"""Is torch's CPU matmul as fast in bf16 as in float32 here? (issue 19, item 7)

Times F.linear for a decode token (1 row) and a prefill chunk (128 rows) against the weight
shapes of SmolLM2-135M and a Llama-3-8B layer, in float32 and bf16, one thread and all. The
CPU path dequantizes to bf16 only where it is as fast (docs/benchmarks.md records the run).

    python bench/diag_cpu_dtype.py
"""

from __future__ import annotations

import json
import platform

import torch
import torch.nn.functional as F
from limits import best_cpu_s

SHAPES = {"smollm2 mlp [1536, 576]": (1536, 576), "llama-8b attn [4096, 4096]": (4096, 4096)}


def main() -> int:
    rows = []
    for threads in (1, torch.get_num_threads()):
        torch.set_num_threads(threads)
        for label, (n, k) in SHAPES.items():
            for tokens in (1, 128):
                times = {}
                for dtype in (torch.float32, torch.bfloat16):
                    w = torch.randn(n, k).to(dtype)
                    x = torch.randn(tokens, k).to(dtype)
                    times[str(dtype).removeprefix("torch.")] = best_cpu_s(
                        lambda x=x, w=w: F.linear(x, w))
                rows.append({"threads": threads, "weight": label, "tokens": tokens,
                             "float32_ms": round(times["float32"] * 1e3, 3),
                             "bf16_ms": round(times["bfloat16"] * 1e3, 3),
                             "bf16_over_float32": round(times["bfloat16"] / times["float32"], 2)})
                print(rows[-1])
    print(json.dumps({"cpu": platform.processor() or platform.machine(),
                      "torch": torch.__version__, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
