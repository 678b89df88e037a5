"""Instructions per weight value of the quantized decode kernel, compiled for a GPU without one.

Compiles quant/kernels.py's planes kernel for sm_90 (Triton's bundled ptxas; no GPU, no CUDA
torch needed), finds the K loop in the SASS and prints its instruction count per weight value
and thread, with the layout conversions (shared-memory round trips) Triton inserted. A decode
GEMV at the HBM roofline has about 7 instructions per 4-bit value to spend on an H200
(33e12 thread instructions/s over 4.6e12 values/s), so this says which tile shapes can reach
it before a GPU run measures them.

    python bench/diag_quant_sass.py [--types Q4_K,Q6_K] [--configs 1:4:1024:4:1,16:32:256:4:3]
    python bench/diag_quant_sass.py --dp4a [--types Q4_K,Q6_K,Q8_0]  # gemv_dp4a.py, its configs
    python bench/diag_quant_sass.py --expert-gemm [--types Q4_K,Q6_K] [--configs R:C:W:M:S,...]
        # expert_gemm.py's gate_up at Qwen3-30B-A3B's shape: registers and stack per config

A config is tokens:BLOCK_ROWS:BLOCK_COLS:num_warps:STAGES (tokens 1: the FMA path, else tl.dot).
With --dp4a: one token through gemv_dp4a.py's integer kernel, every candidate of its type
unless --configs names some (tokens must be 1).
"""

from __future__ import annotations

import argparse
import re
import subprocess
from collections import Counter
from pathlib import Path

import triton
from gguf import GGMLQuantizationType
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from strata.engine.core.quant import kernels

_SIGNATURE = {"x_ptr": "*bf16", "w_ptr": "*u8", "wh_ptr": "*fp16", "table_ptr": "*i8",
              "b_ptr": "*bf16", "out_ptr": "*bf16", "num_tokens": "i32", "stride_x": "i32",
              "stride_out": "i32", "N": "i32", "K": "i32", "ROW_BYTES": "i32"}
# Triton specializes pointers and shapes divisible by 16 at run time; so does this compile.
_DIVISIBLE = ("x_ptr", "w_ptr", "wh_ptr", "table_ptr", "b_ptr", "out_ptr", "stride_x", "N", "K", "ROW_BYTES")
_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?);")


_DP4A_SIGNATURE = {"xq_ptr": "*i32", "xd_ptr": "*fp32", "xs_ptr": "*fp32",
                   "w_ptr": "*u8", "lut_ptr": "*i8", "b_ptr": "*bf16", "out_ptr": "*bf16", "N": "i32",
                   "ROW_BYTES": "i32", "num_groups": "i32"}


def _sass(qtype: int, tokens: int, rows: int, cols: int, warps: int, stages: int,
          dp4a: bool = False):
    if dp4a:
        from strata.engine.core.quant import gemv_dp4a

        fn, base, divisible = gemv_dp4a._dp4a_kernel, _DP4A_SIGNATURE, tuple(_DP4A_SIGNATURE)
        constexprs = {"QTYPE": qtype, "GROUP": gemv_dp4a.GROUP_VALUES[qtype],
                      "HAS_BIAS": False, "USE_PDL": False, "PREWAIT": False,
                      "EMULATE": False}
    else:
        fn, base, divisible = kernels._planes_kernel, _SIGNATURE, _DIVISIBLE
        constexprs = {"QTYPE": qtype, "LANES": kernels.gp.ALL_PLANE_LANES[qtype],
                      "HAS_BIAS": False, "BLOCK_M": 1 if tokens == 1 else 16, "USE_PDL": False}
    constexprs.update(BLOCK_ROWS=rows, BLOCK_COLS=cols, STAGES=stages)
    signature = {**base, **{name: "constexpr" for name in constexprs}}
    index = {name: i for i, name in enumerate(fn.arg_names)}
    source = ASTSource(fn=fn, signature=signature,
                       constexprs={(index[k],): v for k, v in constexprs.items()},
                       attrs={(index[k],): [["tt.divisibility", 16]] for k in divisible})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps})
    return _cuobjdump(compiled, "-sass"), compiled.asm["ttgir"].count("convert_layout")


def _cuobjdump(compiled, flag: str) -> str:
    """cuobjdump's output (Triton's own copy of the tool) for a compiled kernel's cubin."""
    cubin = Path("/tmp/strata_quant_sass.cubin")
    cubin.write_bytes(compiled.asm["cubin"])
    tool = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    return subprocess.run([str(tool), flag, str(cubin)], capture_output=True, text=True,
                          check=True).stdout


_GEMM_SIGNATURE = {"x_ptr": "*bf16", "offsets_ptr": "*i32", "row_w_ptr": "*bf16",
                   "gate_ptr": "*u8", "gate_h_ptr": "*fp16", "up_ptr": "*u8", "up_h_ptr": "*fp16",
                   "lut_ptr": "*i8", "out_ptr": "*bf16", "num_rows": "i32", "rows_hint": "i32",
                   "gate_stride": "i32", "up_stride": "i32", "N": "i32", "K": "i32",
                   "gate_row_bytes": "i32", "up_row_bytes": "i32"}


def expert_gemm_resources(qtype: int, config: tuple[int, ...]) -> str:
    """cuobjdump's resource line (registers, stack: spills) of expert_gemm's gate_up kernel
    for qtype gate and up at 128 experts, config (BLOCK_ROWS, BLOCK_COLS, warps, BLOCK_M,
    STAGES). 255 registers a thread leave one or two programs an SM: what run 21a's slow
    512-token layer (1.86 ms) would look like if the kernel waits on memory."""
    from strata.engine.core.quant import expert_gemm
    from strata.engine.core.quant import gemv_planes as gp

    rows, cols, warps, block_m, stages = config
    fn = expert_gemm._gate_up_kernel
    unit = 16 if qtype in (12, 13) else 2
    constexprs = {"NUM_EXPERTS": 128, "BLOCK_E": 128, "GATE_QTYPE": qtype,
                  "GATE_LANES": gp.ALL_PLANE_LANES.get(qtype, 0), "GATE_UNIT": unit,
                  "UP_QTYPE": qtype, "UP_LANES": gp.ALL_PLANE_LANES.get(qtype, 0),
                  "UP_UNIT": unit, "PRECISION": "native", "USE_PDL": False,
                  "BLOCK_ROWS": rows, "BLOCK_COLS": cols, "BLOCK_M": block_m, "STAGES": stages}
    signature = {**_GEMM_SIGNATURE, **{name: "constexpr" for name in constexprs}}
    index = {name: i for i, name in enumerate(fn.arg_names)}
    pointers = [name for name, kind in _GEMM_SIGNATURE.items() if kind.startswith("*")]
    source = ASTSource(fn=fn, signature=signature,
                       constexprs={(index[k],): v for k, v in constexprs.items()},
                       attrs={(index[k],): [["tt.divisibility", 16]]
                              for k in (*pointers, "N", "K")})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps, "num_stages": stages})
    usage = _cuobjdump(compiled, "-res-usage")
    return next(line.strip() for line in usage.splitlines() if "REG:" in line)


def _loop(sass: str) -> list[str]:
    """The instructions of the first backward branch's loop (the K loop)."""
    code = [(int(m.group(1), 16), m.group(2)) for m in _INSTRUCTION.finditer(sass)]
    at = {address: i for i, (address, _) in enumerate(code)}
    for i, (address, text) in enumerate(code):
        target = re.search(r"BRA.*?0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) < address:
            return [t for _, t in code[at[int(target.group(1), 16)]:i + 1]]
    return []


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", default="Q4_K,Q6_K,Q8_0,Q5_K,Q4_1,Q4_0")
    parser.add_argument("--configs", default=None,
                        help="default 1:4:1024:4:1,1:4:1024:4:3,16:32:256:4:3; with --dp4a "
                             "the type's candidates")
    parser.add_argument("--dp4a", action="store_true",
                        help="gemv_dp4a.py's integer kernel (Q4_K, Q6_K, Q8_0) instead")
    parser.add_argument("--expert-gemm", action="store_true",
                        help="expert_gemm.py's gate_up: registers and stack per config")
    args = parser.parse_args()
    if args.expert_gemm:
        from strata.engine.core.quant import expert_gemm

        configs = ([tuple(int(v) for v in c.split(":")) for c in args.configs.split(",")]
                   if args.configs else expert_gemm.GATE_UP_CONFIGS)
        for name in args.types.split(","):
            for config in configs:
                print(f"{name} gate_up {':'.join(map(str, config))}: "
                      f"{expert_gemm_resources(int(GGMLQuantizationType[name]), config)}")
        return 0
    for name in args.types.split(","):
        qtype = int(GGMLQuantizationType[name])
        if args.configs:
            configs = [tuple(int(v) for v in c.split(":")) for c in args.configs.split(",")]
        elif args.dp4a:
            from strata.engine.core.quant import gemv_dp4a

            configs = [(1, *c) for c in gemv_dp4a.CONFIGS.get(qtype, ())]
        else:
            configs = [(1, 4, 1024, 4, 1), (1, 4, 1024, 4, 3), (16, 32, 256, 4, 3)]
        for tokens, rows, cols, warps, stages in configs:
            config = f"{tokens}:{rows}:{cols}:{warps}:{stages}"
            sass, conversions = _sass(qtype, tokens, rows, cols, warps, stages, args.dp4a)
            loop = _loop(sass)
            values_per_thread = rows * cols // (warps * 32)
            ops = Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in loop)
            print(f"{name} {config}: {len(loop) / values_per_thread:.2f} instructions/value "
                  f"({len(loop)} per loop, {values_per_thread} values per thread), "
                  f"{conversions} layout conversions in the kernel; top: {ops.most_common(6)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
