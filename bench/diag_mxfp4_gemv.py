"""One token's MXFP4 experts (quant/expert_tile_gemv.py, expert_gemv.py's dp4a) at gpt-oss-20b's
shape, by tile choice.

    python bench/diag_mxfp4_gemv.py [--layers 24] [--json OUT.json]

gpt-oss-20b's experts (32 of [2880, 2880] gate, up and down a layer, top-4, expert biases and
the clamped SwiGLU) as random MXFP4 blocks; one CUDA graph replays --layers routed MLPs
(each layer its own weights and experts: nothing is served from L2 between them; the graph
also stacks their outputs), as a decode step does. For each Tiles candidate it prints
microseconds a layer and the GB/s of MXFP4 bytes the four experts hold, against the
device-to-device copy bandwidth measured in the same run (limits.py). The generic tile
decoder (by_block False) is the first row: the kernel before _mxfp4_dots; the second is
the tile GEMV's autotuned launch; the third ("dp4a") expert_gemv's kernels, the path a model
takes for bf16 x (x and the activations rounded to int8: its error vs the first is int8's).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from gguf import GGMLQuantizationType as QT
from limits import hbm_bandwidth_gb_s

from strata.engine.core.fast.expert_epilogue import Epilogue
from strata.engine.core.quant import expert_gemv
from strata.engine.core.quant import expert_tile_gemv as etg
from strata.engine.core.quant.experts import QuantizedExperts

EXPERTS, HIDDEN, INTER, TOP_K = 32, 2880, 2880, 4
# None: routed_mlp's own launch, the autotuner's pick among etg's candidates; DP4A:
# expert_gemv.routed_mlp, autotuned among its dp4a candidates.
DP4A = "dp4a"
CANDIDATES: list[etg.Tiles | str | None] = [etg.Tiles(16, 16, 256, False), None, DP4A] + [
    etg.Tiles(gate_up, down, cols, True)
    for gate_up, down, cols in [(16, 16, 256), (8, 8, 256), (4, 4, 256), (8, 4, 256),
                                (4, 2, 256), (16, 4, 512), (8, 4, 512), (4, 4, 512),
                                (2, 2, 512), (32, 8, 256)]] + [
    etg.Tiles(4, 2, 256, True, 2), etg.Tiles(8, 4, 256, True, 8)]


def random_mxfp4(rows: int, cols: int, generator: torch.Generator) -> QuantizedExperts:
    """[EXPERTS, rows, cols] MXFP4 blocks: random codes, exponents 2**-7..2**-4 (E8M0 120-123)."""
    row_bytes = cols // 32 * 17
    raw = torch.randint(0, 256, (EXPERTS, rows, row_bytes), dtype=torch.uint8,
                        generator=generator, device="cuda")
    raw.view(EXPERTS, rows, cols // 32, 17)[..., 0] = torch.randint(
        120, 124, (EXPERTS, rows, cols // 32), dtype=torch.uint8, generator=generator,
        device="cuda")
    return QuantizedExperts(QT.MXFP4, (EXPERTS, rows, cols), raw, torch.bfloat16)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--json")
    args = parser.parse_args()
    device = torch.device("cuda")
    generator = torch.Generator(device="cuda").manual_seed(0)
    layers = []
    for _ in range(args.layers):
        gate, up = random_mxfp4(INTER, HIDDEN, generator), random_mxfp4(INTER, HIDDEN, generator)
        down = random_mxfp4(HIDDEN, INTER, generator)
        epilogue = Epilogue(*(torch.randn(EXPERTS, n, device=device, generator=generator) * 0.1
                              for n in (INTER, INTER, HIDDEN)), 7.0, 1.702)
        ids = torch.randperm(EXPERTS, device=device, generator=generator)[:TOP_K]
        weights = torch.softmax(torch.randn(TOP_K, device=device, generator=generator), 0)
        layers.append((gate, up, down, epilogue, ids, weights))
    x = torch.randn(HIDDEN, device=device, dtype=torch.bfloat16, generator=generator)
    moved_bytes = TOP_K * 3 * INTER * HIDDEN // 32 * 17
    copy_gb_s = hbm_bandwidth_gb_s(device)
    print(f"copy bandwidth {copy_gb_s:.0f} GB/s; {moved_bytes / 1e6:.1f} MB of MXFP4 a layer")
    reference = None
    rows = []
    for tiles in CANDIDATES:
        def step(t=tiles):
            # Each layer from x: a chain of random layers would overflow bf16.
            if t == DP4A:
                return torch.stack([expert_gemv.routed_mlp(x, gate, up, down, ids, weights,
                                                           epilogue=epilogue)
                                    for gate, up, down, epilogue, ids, weights in layers])
            return torch.stack([etg.routed_mlp(x, gate, up, down, ids, weights,
                                               epilogue=epilogue, tiles=t)
                                for gate, up, down, epilogue, ids, weights in layers])
        out = step()  # compiles
        torch.cuda.synchronize()
        if reference is None:
            reference = out.float()
        error = ((out.float() - reference).norm() / reference.norm()).item()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        layer_us = start.elapsed_time(end) * 1e3 / args.replays / args.layers
        gb_s = moved_bytes / layer_us / 1e3
        label = (tiles if isinstance(tiles, str) else dataclasses.asdict(tiles) if tiles
                 else "autotuned")
        row = {"tiles": label,
               "layer_us": layer_us, "gb_s": gb_s, "of_copy": gb_s / copy_gb_s,
               "relative_error_vs_first": error}
        rows.append(row)
        print(f"{tiles or 'autotuned'}: {layer_us:7.1f} us a layer, {gb_s:6.0f} GB/s "
              f"({gb_s / copy_gb_s:.2f} of copy), error vs first {error:.1e}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"copy_gb_s": copy_gb_s, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
