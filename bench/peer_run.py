"""Strata against llama.cpp on the same random GGUF files, in one command per device call.

    python bench/peer_run.py --plan a --bin-dir DIR --out "$OUT" [--deadline-s 560]
                             [--steps NAME ...]  (steps of any plan, in the order given)

DIR holds llama-bench and llama-batched-bench (CUDA builds, bench/build_llamacpp.sh), plain
or xz-compressed (NAME.xz): they are unpacked into /tmp and run with the CUDA libraries of
torch's `nvidia` package on LD_LIBRARY_PATH. Each step of the plan writes its GGUF file
(random_gguf.py) under --work-dir (/dev/shm when it has room), runs quant_bench.py (issue
19's row: Strata, then llama-bench) or batch_bench.py (issue 22's row: Strata, then
llama-batched-bench) on it in a subprocess, and deletes the file. Steps run in order until
--deadline-s; one that cannot end in time is skipped, a failed one costs only its row.
Everything lands in three files (a device call brings back few): OUT/peer_PLAN.json (each
step's report, rewritten after every step), OUT/peer_PLAN.md (its target rows as one table:
Strata / llama.cpp per figure, peer_table.py) and OUT/peer_PLAN.log (every subprocess's
output). Plan `family` is issue 52's: gpt-oss-20b MXFP4, Gemma-3-27B Q4_0 (QAT layout),
GLM-4.5-Air Q4_K_M (12 of 46 layers) and Phi-4 Q4_K_M; `family-dry` runs it at a tiny width
on the CPU (--device cpu); `family-batch` is the MoE and Gemma files under continuous batching.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import lzma
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
from peer_table import markdown, target_rows
from random_gguf import random_gguf_config, stored_bytes, write_random_gguf

TOOLS = ("llama-bench", "llama-batched-bench")
MIN_STEP_S = 60  # a step with less time left than this is skipped, not started


@dataclass(frozen=True)
class Step:
    name: str
    preset: str
    mix: str
    bench: str  # "quant" (quant_bench.py) or "batch" (batch_bench.py)
    num_layers: int | None = None
    tiny: bool = False  # random_gguf's --tiny: the family at a tiny width (CPU dry runs)
    bench_args: tuple[str, ...] = ()  # before --bench-args, which can override them


# Issue 52's rows: 4 files in one device call (about 560 s), so each bench is trimmed: no
# second load, 2 measured runs a figure (the first, compiling one unmeasured), 2 expert cycles.
_FAMILY_ARGS = ("--decode-tokens", "64", "--prefill-tokens", "512", "4096", "--ttft-tokens",
                "512", "--repeats", "2", "--cycles", "2", "--no-reload")


PLANS = {
    # Call (a): the 8B rows. The batch row's file is F16: Strata computes it in bf16, and F16
    # is read straight from the mapped file by both engines (BF16 goes through gguf-py).
    "a": [Step("llama3-8b-Q4_K_M", "llama3-8b", "Q4_K_M", "quant"),
          Step("llama3-8b-Q8_0", "llama3-8b", "Q8_0", "quant"),
          Step("llama3-8b-F16-batch", "llama3-8b", "F16", "batch")],
    # Call (b): the MoE rows; the float file keeps 12 of 48 layers (the whole is 61 GB).
    "b": [Step("qwen3-30b-a3b-Q4_K_M", "qwen3-30b-a3b", "Q4_K_M", "quant"),
          Step("qwen3-30b-a3b-IQ2_XXS", "qwen3-30b-a3b", "IQ2_XXS", "quant"),
          Step("qwen3-30b-a3b-12L-F16-batch", "qwen3-30b-a3b", "F16", "batch", 12)],
    # If device time is left: the Qwen Q8_0 row and the quantized batch rows (the 12-layer
    # MoE file: run 15's F16 batch row's shape, quantized experts through expert_batch.py).
    "c": [Step("qwen3-30b-a3b-Q8_0", "qwen3-30b-a3b", "Q8_0", "quant"),
          Step("llama3-8b-Q4_K_M-batch", "llama3-8b", "Q4_K_M", "batch"),
          Step("qwen3-30b-a3b-12L-Q4_K_M-batch", "qwen3-30b-a3b", "Q4_K_M", "batch", 12),
          Step("qwen3-30b-a3b-Q4_K_M-batch", "qwen3-30b-a3b", "Q4_K_M", "batch")],
    # A CPU dry run of the machinery (tiny files need --device cpu and no binaries).
    "dry": [Step("smollm2-Q8_0", "smollm2-135m", "Q8_0", "quant", 2),
            Step("smollm2-Q8_0-batch", "smollm2-135m", "Q8_0", "batch", 2)],
    # Issue 52's targets: the families' files in their published mixes (random_gguf.py;
    # 12.1, 17.2 and 9.1 GB whole). GLM-4.5-Air keeps 12 of 46 layers (18 GB; whole it is
    # 70 GB, past /dev/shm and the disk), typed as llama-quantize types a 12-layer model.
    "family": [Step("gpt-oss-20b-MXFP4", "gpt-oss-20b", "MXFP4_MOE", "quant",
                    bench_args=_FAMILY_ARGS),
               Step("gemma-3-27b-Q4_0", "gemma-3-27b", "Q4_0_QAT", "quant",
                    bench_args=_FAMILY_ARGS),
               Step("glm-4.5-air-12L-Q4_K_M", "glm-4.5-air", "Q4_K_M", "quant", 12,
                    bench_args=_FAMILY_ARGS),
               Step("phi-4-Q4_K_M", "phi-4", "Q4_K_M", "quant", bench_args=_FAMILY_ARGS)],
    # Issue 52's batched rows: the families' quantized files under continuous batching
    # (MXFP4 and GLM's experts through expert_batch.py), against llama-batched-bench.
    "family-batch": [Step("gpt-oss-20b-MXFP4-batch", "gpt-oss-20b", "MXFP4_MOE", "batch"),
                     Step("gemma-3-27b-Q4_0-batch", "gemma-3-27b", "Q4_0_QAT", "batch"),
                     Step("glm-4.5-air-12L-Q4_K_M-batch", "glm-4.5-air", "Q4_K_M", "batch",
                          12)],
    # The same on the CPU at a tiny width (with --device cpu): the machinery, and llama.cpp's
    # loader on each family's file when --bin-dir holds a CPU llama-bench.
    "family-dry": [Step("gpt-oss-tiny-MXFP4", "gpt-oss-20b", "MXFP4_MOE", "quant", tiny=True,
                        bench_args=("--cycles", "1")),
                   Step("gemma-3-tiny-Q4_0", "gemma-3-27b", "Q4_0_QAT", "quant", tiny=True),
                   Step("glm-4.5-tiny-Q4_K_M", "glm-4.5-air", "Q4_K_M", "quant", tiny=True,
                        bench_args=("--cycles", "1")),
                   Step("phi-4-tiny-Q4_K_M", "phi-4", "Q4_K_M", "quant", tiny=True)],
}


def cuda_library_dirs() -> list[str]:
    """The lib folders of torch's `nvidia` wheels (cu13/lib holds libcudart and libcublas)."""
    spec = importlib.util.find_spec("nvidia")
    if spec is None or not spec.submodule_search_locations:
        return []
    return sorted(str(d) for root in spec.submodule_search_locations
                  for d in Path(root).glob("*/lib") if d.is_dir())


def unpack_tools(bin_dir: Path, dest: Path, log) -> dict[str, str]:
    """tool name -> runnable path, for each tool found in bin_dir (NAME or NAME.xz)."""
    dest.mkdir(parents=True, exist_ok=True)
    tools = {}
    for name in TOOLS:
        target = dest / name
        if (bin_dir / f"{name}.xz").is_file():
            # lzma, not the xz tool: a bare machine may lack xz-utils.
            with lzma.open(bin_dir / f"{name}.xz") as packed, target.open("wb") as out:
                shutil.copyfileobj(packed, out, 1 << 22)
        elif (bin_dir / name).is_file():
            shutil.copyfile(bin_dir / name, target)
        else:
            log(f"no {name} in {bin_dir}: its rows run Strata alone")
            continue
        target.chmod(0o755)
        missing = [ln.strip() for ln in subprocess.run(
            ["ldd", str(target)], capture_output=True, text=True).stdout.splitlines()
            if "not found" in ln]
        log(f"{name}: {target}" + (f"; MISSING LIBRARIES {missing}" if missing else ""))
        tools[name] = str(target)
    return tools


def work_dir(choice: str, file_bytes: int) -> Path:
    """Where a file of file_bytes goes: `choice`, or for "auto" /dev/shm when it has room
    (tmpfs: writing costs no disk time, and it is the page cache both engines load from),
    else /tmp (a disk whose write speed is unknown; its pages stay cached)."""
    candidates = [Path("/dev/shm/peer-gguf"), Path("/tmp/peer-gguf")] if choice == "auto" \
        else [Path(choice)]
    for folder in candidates:
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if shutil.disk_usage(folder).free > file_bytes + (256 << 20) or folder == candidates[-1]:
            return folder
    raise OSError(f"none of {candidates} can be made")


def bench_command(step: Step, path: Path, json_path: Path, tools: dict, args) -> list[str]:
    python = [sys.executable]
    if step.bench == "quant":
        cmd = [*python, str(BENCH_DIR / "quant_bench.py"), str(path), "--label", step.name,
               "--json", str(json_path), "--hbm-gb-s", str(args.hbm_gb_s)]
        if "llama-bench" in tools:
            cmd += ["--llama-bench", tools["llama-bench"]]
    else:
        cmd = [*python, str(BENCH_DIR / "batch_bench.py"), "--gguf", str(path),
               "--json", str(json_path)]
        if "llama-batched-bench" in tools:
            cmd += ["--llama-batched-bench", tools["llama-batched-bench"]]
    if args.device == "cpu":  # the dry run: tiny prompts
        cmd += ["--device", "cpu"]
        cmd += (["--prefill-tokens", "32", "64", "--ttft-tokens", "32", "--decode-tokens", "8",
                 "--repeats", "1"] if step.bench == "quant" else
                ["--streams", "1", "2", "--slots", "2", "--prompt-tokens", "16",
                 "--max-tokens", "8", "--no-ttft"])
    return cmd + list(step.bench_args) + args.bench_args


def run_step(step: Step, tools: dict, env: dict, args, log, log_file) -> dict:
    """Write the file, bench it, delete it; the step's record."""
    record: dict = {"step": asdict(step)}
    remaining_s = args.deadline_s - (time.perf_counter() - args.started_s)
    if remaining_s < MIN_STEP_S:
        record["status"] = f"skipped: {remaining_s:.0f} s left of {args.deadline_s:.0f} s"
        log(f"{step.name}: {record['status']}")
        return record
    config = random_gguf_config(step.preset, step.num_layers, step.tiny)
    work = work_dir(args.work_dir, stored_bytes(config, step.mix))
    path, json_path = work / f"{step.name}.gguf", work / f"{step.name}.json"
    try:
        t0 = time.perf_counter()
        write_random_gguf(step.preset, path, mix=step.mix, num_layers=step.num_layers,
                          tiny=step.tiny)
        record |= {"write_s": round(time.perf_counter() - t0, 1),
                   "file_bytes": path.stat().st_size}
        log(f"{step.name}: wrote {path.stat().st_size / 1e9:.2f} GB in {record['write_s']} s "
            f"to {path}")
        remaining_s = args.deadline_s - (time.perf_counter() - args.started_s)
        command = bench_command(step, path, json_path, tools, args)
        log(f"{step.name}: {' '.join(command)} (timeout {remaining_s:.0f} s)")
        json_path.unlink(missing_ok=True)
        t0 = time.perf_counter()
        # A session of its own: a timeout ends the bench and the llama.cpp tool it started.
        proc = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            returncode = proc.wait(timeout=max(remaining_s, 1))
            record["status"] = "ok" if returncode == 0 else f"exit {returncode}"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            record["status"] = f"timed out after {remaining_s:.0f} s"
        record["bench_s"] = round(time.perf_counter() - t0, 1)
        if json_path.is_file():
            record["report"] = json.loads(json_path.read_text())
        log(f"{step.name}: {record['status']} in {record['bench_s']} s")
    except Exception as exc:  # noqa: BLE001 - one failed step must not lose the others
        record["status"] = f"failed: {type(exc).__name__}: {exc}"
        log(f"{step.name}: {record['status']}")
    finally:
        path.unlink(missing_ok=True)
        json_path.unlink(missing_ok=True)
    return record


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", required=True, choices=sorted(PLANS))
    parser.add_argument("--steps", nargs="+", help="only these steps (names from any plan)")
    parser.add_argument("--bin-dir", default="llamacpp-bin",
                        help="folder with llama-bench / llama-batched-bench (or NAME.xz)")
    parser.add_argument("--out", default=os.environ.get("OUT", "peer-out"))
    parser.add_argument("--work-dir", default="auto",
                        help="where the files go (auto: /dev/shm when it has room, else /tmp)")
    parser.add_argument("--deadline-s", type=float, default=560.0)
    parser.add_argument("--hbm-gb-s", type=float, default=4300.0)
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of the machinery")
    parser.add_argument("--bench-args", nargs=argparse.REMAINDER, default=[],
                        help="passed on to every bench script (last)")
    args = parser.parse_args()
    args.started_s = time.perf_counter()
    every = {step.name: step for plan in PLANS.values() for step in plan}
    unknown = sorted(set(args.steps or ()) - set(every))
    if unknown:
        raise SystemExit(f"peer_run: unknown steps {unknown}; known: {sorted(every)}")
    steps = [every[name] for name in args.steps] if args.steps else PLANS[args.plan]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log_path, json_path = out / f"peer_{args.plan}.log", out / f"peer_{args.plan}.json"
    table_path = out / f"peer_{args.plan}.md"  # the target rows (peer_table.py)
    with log_path.open("w", buffering=1) as log_file:
        def log(message: str) -> None:
            line = f"[peer_run {time.perf_counter() - args.started_s:6.1f}s] {message}"
            print(line, flush=True)
            log_file.write(line + "\n")

        tools = unpack_tools(Path(args.bin_dir), Path("/tmp/llamacpp-bin"), log)
        lib_dirs = cuda_library_dirs()
        # The checkout first, then what the caller's PYTHONPATH already had (packages
        # installed with --target, as on a machine without a virtual environment).
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
                   [str(BENCH_DIR.parent), *filter(None, [os.environ.get("PYTHONPATH")])]),
               "LD_LIBRARY_PATH": os.pathsep.join(
                   [*lib_dirs, *filter(None, [os.environ.get("LD_LIBRARY_PATH")])])}
        log(f"LD_LIBRARY_PATH += {lib_dirs}")
        # Re-check the tools now that the libraries are on the path.
        for name, path in tools.items():
            ldd = subprocess.run(["ldd", path], capture_output=True, text=True, env=env).stdout
            missing = [ln.strip() for ln in ldd.splitlines() if "not found" in ln]
            if missing:
                log(f"{name} still lacks {missing}")
        report = {"plan": args.plan, "command": " ".join(sys.argv), "tools": tools,
                  "ld_library_path": lib_dirs, "steps": []}
        for step in steps:
            log_file.flush()
            report["steps"].append(run_step(step, tools, env, args, log, log_file))
            json_path.write_text(json.dumps(report, indent=1, default=str))
            table_path.write_text(markdown(target_rows(report)))
        log(f"done in {time.perf_counter() - args.started_s:.0f} s: {json_path}")
    for record in report["steps"]:
        print(f"{record['step']['name']}: {record['status']}")
    print(table_path.read_text(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
