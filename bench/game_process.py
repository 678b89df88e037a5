"""A stand-in for a game: allocate VRAM as soon as it starts, hold it, exit.

    python bench/game_process.py --bytes N --hold-s S --out result.json [--api cuda|torch]

With --api cuda (default) it uses the CUDA driver API directly (cuda-python), so its first
allocation comes about 0.3 s after the process starts, as a real game's does; --api torch imports
torch first (seconds); --api none allocates nothing (the scenario's CPU dry run). The first
allocation is tried once and recorded, then retried every 20 ms for up to 10 s (a game that
retries); the result JSON has the wall-clock times of each, which the scenario compares with the
time it started the process. --bytes 0 only creates the context (the scenario measures what a
context costs).
"""

from __future__ import annotations

import argparse
import json
import time

RETRY_S = 0.02
RETRY_FOR_S = 10.0


def cuda_allocator():
    from cuda.bindings import driver as cu

    def check(result):
        if result[0] != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"CUDA driver error {result[0]}")
        return result[1] if len(result) > 1 else None

    check(cu.cuInit(0))
    context = check(cu.cuDevicePrimaryCtxRetain(check(cu.cuDeviceGet(0))))
    check(cu.cuCtxSetCurrent(context))

    def alloc(num_bytes: int):
        result = cu.cuMemAlloc(num_bytes)
        return result[1] if result[0] == cu.CUresult.CUDA_SUCCESS else None

    return alloc


def torch_allocator():
    import torch

    torch.cuda.init()

    def alloc(num_bytes: int):
        try:
            return torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
        except torch.cuda.OutOfMemoryError:
            return None

    return alloc


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bytes", type=int, required=True)
    parser.add_argument("--hold-s", type=float, default=3.0)
    parser.add_argument("--api", choices=("cuda", "torch", "none"), default="cuda")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.api == "none":  # a CPU dry run of the scenario: nothing to allocate on
        def alloc(num_bytes: int) -> bytes:
            return b""
    else:
        alloc = cuda_allocator() if args.api == "cuda" else torch_allocator()
    context_at = time.time()
    result = {"bytes": args.bytes, "api": args.api, "context_at": context_at}
    held = None
    if args.bytes > 0:
        result["first_at"] = time.time()
        held = alloc(args.bytes)
        result["first_ok"] = held is not None
        num_tries = 1
        deadline = time.time() + RETRY_FOR_S
        while held is None and time.time() < deadline:
            time.sleep(RETRY_S)
            held = alloc(args.bytes)
            num_tries += 1
        result.update(ok=held is not None, ok_at=time.time(), num_tries=num_tries)
    with open(args.out, "w") as f:
        json.dump(result, f)
    time.sleep(args.hold_s)
    return 0 if args.bytes == 0 or held is not None else 1


if __name__ == "__main__":
    raise SystemExit(main())
