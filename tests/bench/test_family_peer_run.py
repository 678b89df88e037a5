"""Issue 52's family rows through bench/peer_run.py: the plan's files fit the GPU machine,
the target table reads quant_bench's figures, the CPU dry run writes and benches each
family's tiny file and, with a CPU llama-bench (STRATA_LLAMA_BENCH_CPU, built by
bench/build_llamacpp.sh ... cpu), llama.cpp loads and runs each of them too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from peer_run import PLANS
from peer_table import markdown, target_rows
from random_gguf import random_gguf_config, stored_bytes, write_random_gguf

SHM_BYTES = 64 * 2**30  # half the GPU machines' 128 GiB: /dev/shm's default size
LLAMA_BENCH_CPU = os.environ.get("STRATA_LLAMA_BENCH_CPU")
# The development VMs report AMX but fault on its tile instructions (SIGILL in ggml's AMX
# matmul of repacked weights): llama.cpp runs there with repacking off.
NO_REPACK = ("--repack", "0")


def test_the_family_plan_is_the_issues_four_files_and_each_fits_dev_shm() -> None:
    steps = PLANS["family"]
    assert [(s.preset, s.mix) for s in steps] == [
        ("gpt-oss-20b", "MXFP4_MOE"), ("gemma-3-27b", "Q4_0_QAT"), ("glm-4.5-air", "Q4_K_M"),
        ("phi-4", "Q4_K_M")]
    for step in steps:
        nbytes = stored_bytes(random_gguf_config(step.preset, step.num_layers), step.mix)
        assert nbytes < SHM_BYTES / 2, step  # room for the page cache the engines load from
        options = list(step.bench_args)
        assert options[options.index("--prefill-tokens") + 1:][:2] == ["512", "4096"]
    assert [s.preset for s in PLANS["family-dry"]] == [s.preset for s in steps]
    for step in PLANS["family-batch"]:  # the same files, batched
        assert step.bench == "batch" and (step.preset, step.mix, step.num_layers) in {
            (s.preset, s.mix, s.num_layers) for s in steps}, step
    assert all(s.tiny for s in PLANS["family-dry"])


def _figure(name: str, value, limit, target=None, ok=None, unit="tok/s") -> dict:
    ratio = None if limit is None or value is None else value / limit
    return {"figure": name, "value": value, "unit": unit, "limit": limit, "ratio": ratio,
            "target": target, "ok": ok, "notes": ""}


def test_the_table_keeps_the_target_rows_of_each_step_and_says_what_was_missed() -> None:
    report = {"steps": [
        {"step": {"name": "phi"}, "status": "ok", "report": {"label": "phi", "figures": [
            _figure("phi load to ready (first, page cache)", 3.0, None, unit="s"),
            _figure("phi decode bs1", 130.0, 400.0, 0.6, False),
            _figure("phi prefill 4096 tok", 9000.0, None),
            _figure("phi VRAM held after load", 9.5, 9.0, 1.1, True, unit="GiB"),
            _figure("phi vs llama.cpp decode bs1", 130.0, 100.0, 1.2, True),
            _figure("phi vs llama.cpp prefill 4096 tok", 9000.0, 10000.0, 1.0, False)]}},
        {"step": {"name": "glm"}, "status": "timed out after 20 s"}]}
    rows = target_rows(report)
    assert [(r["step"], r["figure"]) for r in rows] == [
        ("phi", "decode bs1"), ("phi", "prefill 4096 tok"), ("phi", "VRAM held after load"),
        ("phi", "vs llama.cpp decode bs1"), ("phi", "vs llama.cpp prefill 4096 tok"),
        ("glm", "(timed out after 20 s)")]
    lines = markdown(rows).splitlines()
    assert lines[0].startswith("| step | figure | Strata |") and len(lines) == 2 + len(rows)
    assert lines[5] == "| phi | vs llama.cpp decode bs1 | 130.00 | tok/s | 100.00 | 1.30 | 1.20 | ok |"
    assert lines[6].endswith("| 0.90 | 1.00 | **MISSED** |")


def test_llama_cpps_rows_stay_when_strata_fails_on_the_file(tmp_path: Path) -> None:
    """A family Strata cannot run yet still gets llama.cpp's figures on its file: here the
    engine is asked for a device that does not exist; llama-bench is a stand-in printing a
    real CPU run's JSON (tests/bench/data/llama-bench-cpu.json)."""
    from quant_bench import parser, run

    path = tmp_path / "phi.gguf"
    write_random_gguf("phi-4", path, mix="Q4_K_M", tiny=True)
    recorded = ROOT / "tests" / "bench" / "data" / "llama-bench-cpu.json"
    fake = tmp_path / "llama-bench"
    fake.write_text(f"#!/bin/sh\ncat {recorded}\n")
    fake.chmod(0o755)
    args = parser().parse_args([str(path), "--device", "no-such-device", "--llama-bench", str(fake),
                                "--prefill-tokens", "64", "256", "--decode-tokens", "8",
                                "--json", str(tmp_path / "q.json")])
    report = run(args)
    assert "Traceback" in report["strata"]["error"]
    rows = {r["figure"]: r for r in target_rows({"steps": [
        {"step": {"name": "phi"}, "status": "exit 1", "report": report}]})}
    assert rows["Strata"]["value"] is None and "Strata failed" in rows["Strata"]["notes"]
    decode = rows["vs llama.cpp decode bs1"]
    assert decode["value"] is None and decode["limit"] > 0 and decode["ok"] is None
    assert json.loads((tmp_path / "q.json").read_text())["llamacpp"]["decode_tok_s"] > 0


@pytest.mark.slow
def test_family_dry_plan_benches_every_family_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "out"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if LLAMA_BENCH_CPU:  # with AMX repacking off (see below), by a wrapper peer_run copies
        wrapper = bin_dir / "llama-bench"
        wrapper.write_text(f'#!/bin/sh\nexec {LLAMA_BENCH_CPU} "$@" {" ".join(NO_REPACK)}\n')
        wrapper.chmod(0o755)
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "peer_run.py"), "--plan", "family-dry",
         "--device", "cpu", "--bin-dir", str(bin_dir), "--out", str(out),
         "--work-dir", str(tmp_path / "files")],
        capture_output=True, text=True, timeout=900, env={"PYTHONPATH": str(ROOT),
                                                         "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads((out / "peer_family-dry.json").read_text())
    assert [r["status"] for r in report["steps"]] == ["ok"] * 4, report["steps"]
    table = (out / "peer_family-dry.md").read_text()
    for step in PLANS["family-dry"]:
        assert f"| {step.name} | decode bs1 |" in table
        assert f"| {step.name} | prefill 64 tok |" in table
        if LLAMA_BENCH_CPU:  # llama.cpp loaded the file and ran it
            assert f"| {step.name} | vs llama.cpp decode bs1 |" in table
    for moe in ("gpt-oss-tiny-MXFP4", "glm-4.5-tiny-Q4_K_M"):
        assert f"| {moe} | refill experts incl. mapping |" in table
    assert not list((tmp_path / "files").glob("*.gguf"))


@pytest.mark.skipif(not LLAMA_BENCH_CPU, reason="STRATA_LLAMA_BENCH_CPU names no CPU "
                    "llama-bench (bench/build_llamacpp.sh SRC BUILD cpu)")
@pytest.mark.parametrize(("preset", "mix"), [(s.preset, s.mix) for s in PLANS["family"]])
def test_llama_cpp_loads_and_runs_each_familys_file(tmp_path: Path, preset: str,
                                                    mix: str) -> None:
    path = tmp_path / f"{preset}.gguf"
    write_random_gguf(preset, path, mix=mix, tiny=True)
    done = subprocess.run([LLAMA_BENCH_CPU, "-m", str(path), "-p", "8", "-n", "4", "-r", "1",
                           "-o", "json", *NO_REPACK], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    tests = json.loads(done.stdout[done.stdout.index("["):])
    assert {(t["n_prompt"], t["n_gen"]) for t in tests} == {(8, 0), (0, 4)}
    assert all(t["avg_ts"] > 0 for t in tests)
