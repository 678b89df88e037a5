"""Sweep block shapes of the grouped MoE decode kernels on Qwen3-30B-A3B shapes (one H200 run).

    python bench/sweep_moe.py      # writes $OUT/sweep_moe.json (or ./sweep_moe.json)

Times every (BLOCK_ROWS, BLOCK_COLS, num_warps, num_stages) of fast/moe_triton.py's two
decode kernels with CUDA-graph replays and checks each against a float32 reference; the
winners are the candidate lists in moe_triton.py. About 150 s of compiling and timing.
"""
import itertools, json, os, time
import torch, triton
from triton.testing import do_bench_cudagraph
from strata.engine.core.fast import moe_triton as mt

E, I, H, K = 128, 768, 2048, 8
dev = "cuda"
gate = torch.randn(E, I, H, device=dev, dtype=torch.bfloat16) * 0.02
up = torch.randn(E, I, H, device=dev, dtype=torch.bfloat16) * 0.02
down = torch.randn(E, H, I, device=dev, dtype=torch.bfloat16) * 0.02
x = torch.randn(H, device=dev, dtype=torch.bfloat16)
ids = torch.randperm(E, device=dev)[:K].contiguous()
w = torch.rand(K, device=dev, dtype=torch.bfloat16)
act = torch.randn(K, I, device=dev, dtype=torch.bfloat16)
out_gu = torch.empty(K, I, device=dev, dtype=torch.bfloat16)
out_d = torch.empty(H, device=dev, dtype=torch.bfloat16)
ref_gu = (torch.nn.functional.silu(gate[ids].float() @ x.float()) * (up[ids].float() @ x.float()))
ref_d = ((down[ids].float() @ act.float()[:, :, None]).squeeze(-1) * w.float()[:, None]).sum(0)
gu_bytes = 2 * K * I * H * 2; d_bytes = K * H * I * 2
res = {"gate_up": [], "down_sum": []}
t_start = time.time()
for br, bc, nw, ns in itertools.product((1, 2, 4, 8, 16, 32), (256, 512, 1024, 2048), (2, 4, 8), (1, 3)):
    if br * bc > 16384 or time.time() - t_start > 150: continue
    try:
        f = lambda: mt._gate_up_kernel[(K, triton.cdiv(I, br))](x, gate, up, ids, out_gu, gate.stride(0), gate.stride(1), num_cols=H, num_rows=I, BLOCK_ROWS=br, BLOCK_COLS=bc, num_warps=nw, num_stages=ns)
        f(); torch.cuda.synchronize()
        err = (out_gu.float() - ref_gu).abs().max().item()
        us = do_bench_cudagraph(f, rep=20) * 1e3
        res["gate_up"].append((br, bc, nw, ns, round(us, 2), round(gu_bytes / us / 1e3, 1), err))
    except Exception as ex:
        res["gate_up"].append((br, bc, nw, ns, None, str(ex)[:80]))
    if bc > 1024: continue
    try:
        g = lambda: mt._down_sum_kernel[(triton.cdiv(H, br),)](act, down, ids, w, out_d, down.stride(0), down.stride(1), num_cols=I, num_rows=H, top_k=K, BLOCK_ROWS=br, BLOCK_COLS=bc, num_warps=nw, num_stages=ns)
        g(); torch.cuda.synchronize()
        err = (out_d.float() - ref_d).abs().max().item()
        us = do_bench_cudagraph(g, rep=20) * 1e3
        res["down_sum"].append((br, bc, nw, ns, round(us, 2), round(d_bytes / us / 1e3, 1), err))
    except Exception as ex:
        res["down_sum"].append((br, bc, nw, ns, None, str(ex)[:80]))
for k in res:
    ok = sorted([r for r in res[k] if r[4] is not None], key=lambda r: r[4])
    print(k, "best 8 (BR, BC, warps, stages, us, GB/s, err):")
    for r in ok[:8]: print("  ", r)
    cur = [r for r in ok if (r[0], r[1], r[2]) in {(16, 256, 4), (8, 256, 4)} and r[3] == 1]
    print("  current-like:", cur[:3])
json.dump(res, open(os.environ.get("OUT", ".") + "/sweep_moe.json", "w"))
