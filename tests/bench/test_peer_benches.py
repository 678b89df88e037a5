"""The peer benchmarks' pieces that run without a GPU: the quantized-bytes roofline of a file,
the plans of bench/peer_run.py, and (slow) quant_bench.py and batch_bench.py dry runs on the
CPU over a tiny random GGUF file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from gguf_mix import FILE_TYPES
from peer_run import PLANS
from random_gguf import random_gguf_config, stored_bytes, write_random_gguf
from roofline import decode_weight_bytes

from strata.engine.core.model_config import ModelConfig
from strata.engine.gguf_file import open_gguf

TINY_MOE = ModelConfig(model_type="qwen3_moe", vocab_size=512, hidden_size=256,
                       intermediate_size=512, moe_intermediate_size=256, num_experts=4,
                       num_experts_per_tok=1, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=64, max_position_embeddings=512)
DISK_BYTES = 64 * 2**30  # the H200 machine's disk


def test_moe_roofline_reads_the_used_share_of_the_experts(tmp_path: Path) -> None:
    path = tmp_path / "moe.gguf"
    write_random_gguf(TINY_MOE, path, mix="Q4_K_M")
    reader = open_gguf(path)
    sizes = {t.name: t.n_bytes for t in reader.tensors}
    experts = sum(n for name, n in sizes.items() if "_exps." in name)
    weights = decode_weight_bytes(reader)
    assert weights["total_bytes"] == sum(sizes.values())
    assert weights["expert_bytes"] == experts > 0
    # One of four experts, and one row of the embedding (not counted) per token.
    expected = sum(sizes.values()) - sizes["token_embd.weight"] - experts + experts // 4
    assert weights["per_token_bytes"] == expected


def test_every_plan_step_is_a_file_the_writer_makes_and_the_disk_holds() -> None:
    for steps in PLANS.values():
        for step in steps:
            assert step.mix in FILE_TYPES and step.bench in ("quant", "batch")
            nbytes = stored_bytes(random_gguf_config(step.preset, step.num_layers, step.tiny),
                                  step.mix)
            assert nbytes < DISK_BYTES * 0.6, step  # the checkout, caches and torch fit too


@pytest.mark.slow
def test_peer_run_dry_plan_runs_both_benches_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "peer_run.py"), "--plan", "dry", "--device", "cpu",
         "--bin-dir", str(tmp_path / "no-binaries"), "--out", str(out),
         "--work-dir", str(tmp_path / "files")],
        capture_output=True, text=True, timeout=600, env={"PYTHONPATH": str(ROOT),
                                                         "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads((out / "peer_dry.json").read_text())
    step, batch = report["steps"]
    assert step["status"] == batch["status"] == "ok", report["steps"]
    assert [r["streams"] for r in batch["report"]["streams"]] == [1, 2]
    figures = {f["figure"]: f for f in step["report"]["figures"]}
    assert figures["smollm2-Q8_0 decode bs1"]["value"] > 0
    assert figures["smollm2-Q8_0 TTFT 32 tok"]["unit"] == "ms"
    # The CPU engine runs the plain torch path: every prompt called, no graphs.
    assert step["report"]["strata"]["prefill_plan"] == {
        "fast_path": False, "graph_tokens": 0, "expert_graphs": False, "compiled_groups": False}
    assert not list((tmp_path / "files").glob("*.gguf"))  # each file is deleted after its row
    assert "decode bs1" in (out / "peer_dry.log").read_text()


@pytest.mark.slow
def test_batch_bench_runs_on_a_gguf_file_on_the_cpu(tmp_path: Path) -> None:
    path = tmp_path / "moe.gguf"
    write_random_gguf(TINY_MOE, path, mix="IQ2_XXS")
    json_path = tmp_path / "batch.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "batch_bench.py"), "--gguf", str(path),
         "--device", "cpu", "--streams", "1", "2", "--slots", "2", "--prompt-tokens", "16",
         "--max-tokens", "6", "--no-ttft", "--json", str(json_path)],
        capture_output=True, text=True, timeout=600, env={"PYTHONPATH": str(ROOT),
                                                         "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(json_path.read_text())["streams"]
    assert [r["streams"] for r in rows] == [1, 2]
    assert rows[1]["decode_tokens"] == 2 * 5  # every token after each stream's first


def test_tools_are_unpacked_from_xz_or_copied_and_made_executable(tmp_path: Path) -> None:
    import lzma
    import os

    from peer_run import unpack_tools

    bins = tmp_path / "bins"
    bins.mkdir()
    with lzma.open(bins / "llama-bench.xz", "wb") as packed:
        packed.write(b"#!/bin/sh\necho bench\n")
    (bins / "llama-batched-bench").write_bytes(b"#!/bin/sh\necho batched\n")
    lines: list[str] = []
    tools = unpack_tools(bins, tmp_path / "out", lines.append)
    assert sorted(tools) == ["llama-batched-bench", "llama-bench"]
    said = {"llama-bench": "bench", "llama-batched-bench": "batched"}
    for name, path in tools.items():
        assert os.access(path, os.X_OK)
        assert subprocess.run([path], capture_output=True, text=True).stdout.strip() == said[name]
    assert len(lines) == 2


def test_quant_bench_profiles_a_prefill_and_records_its_plan_on_the_cpu(tmp_path: Path) -> None:
    """--profile-prefill: one fresh prompt of that length under torch.profiler, after the
    timed rows (the CPU has no kernels to list: the machinery and the JSON)."""
    path = tmp_path / "tiny.gguf"
    write_random_gguf("smollm2-135m", path, mix="Q8_0", num_layers=2)
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "quant_bench.py"), str(path), "--device", "cpu",
         "--decode-tokens", "4", "--prefill-tokens", "16", "--ttft-tokens", "16", "--repeats",
         "1", "--no-reload", "--profile-prefill", "12", "--json", str(tmp_path / "q.json")],
        capture_output=True, text=True, timeout=600, env={"PYTHONPATH": str(ROOT),
                                                         "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    strata = json.loads((tmp_path / "q.json").read_text())["strata"]
    assert strata["prefill_profile"]["tokens"] == 12 and strata["prefill_profile"]["wall_us"] > 0
    runs = strata["prefill_16_runs_s"]  # the unmeasured first run, then --repeats 1
    assert len(runs) == 2 and strata["prefill_16_s"] == runs[1] > 0
    assert "prefill of 12 tokens" in done.stdout
    assert strata["deferred"] == {"steps": [], "seconds": strata["deferred"]["seconds"]}
    assert strata["device"]["type"] == "cpu" and strata["device"]["torch"] == torch.__version__


def test_quant_bench_sets_strata_against_a_recorded_llama_bench_run(tmp_path: Path) -> None:
    from argparse import Namespace

    from quant_bench import llamacpp_figures

    recorded = ROOT / "tests" / "bench" / "data" / "llama-bench-cpu.json"
    tests = {(t["n_prompt"], t["n_gen"]): t["avg_ts"] for t in json.loads(recorded.read_text())}
    fake = tmp_path / "llama-bench"  # prints what a real llama-bench run printed
    fake.write_text(f"#!/bin/sh\ncat {recorded}\n")
    fake.chmod(0o755)
    args = Namespace(llama_bench=str(fake), prefill_tokens=[64, 256], decode_tokens=8,
                     ubatch=2048, llamacpp_timeout_s=60)
    ours = {"decode_tok_s": 100.0, "prefill_256_s": 0.5, "prefill_64_s": 0.25}
    rows, peer = llamacpp_figures(args, tmp_path / "m.gguf", ours)
    by_name = {r["figure"]: r for r in rows}
    assert by_name["vs llama.cpp decode bs1"]["limit"] == tests[(0, 8)]
    assert by_name["vs llama.cpp decode bs1"]["ratio"] == pytest.approx(100.0 / tests[(0, 8)])
    assert by_name["vs llama.cpp prefill 256 tok"]["ratio"] == pytest.approx(512 / tests[(256, 0)])
    assert by_name["vs llama.cpp prefill 64 tok"]["limit"] == pytest.approx(tests[(64, 0)])
    assert "-fa 1" in peer["command"] and "-ngl 99" in peer["command"]


def test_quant_bench_pins_only_tiles_another_run_recorded(tmp_path: Path) -> None:
    """--pin-tiles reads a JSON of this bench: one without tiles, or with a tile this tree
    cannot run, stops the bench with one line naming the file (gemv_dp4a.pin_tiles checks
    the tiles; tests/core/test_quant_dp4a.py pins them)."""
    from quant_bench import pin_tiles

    bare = tmp_path / "cpu.json"
    bare.write_text(json.dumps({"strata": {"decode_tok_s": 1.0}}))
    with pytest.raises(SystemExit, match="records no dp4a tiles"):
        pin_tiles(str(bare))
    odd = tmp_path / "odd.json"
    odd.write_text(json.dumps({"strata": {"dp4a_tiles": {
        "_dp4a_kernel type 12": {"(1, 2, 12)": "BLOCK_ROWS: 999"}}}}))
    with pytest.raises(SystemExit, match=f"--pin-tiles {odd}: "):
        pin_tiles(str(odd))
