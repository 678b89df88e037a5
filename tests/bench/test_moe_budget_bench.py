"""bench/moe_budget_bench.py: the budget arithmetic both engines get, llama-bench's command and
results, and the whole bench end to end on the CPU over a tiny random MoE GGUF (forced
routes through the real engine: the imposed uniform trace misses where the model's own
routes hit)."""

from __future__ import annotations

import argparse
import json
import stat
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import moe_budget_bench as bench
import moe_budget_llamacpp as budget_peer
from moe_budget_bench_args import parse_budget
from random_gguf import write_random_gguf

from strata.engine.core.model_config import ModelConfig
from strata.units import MIB

TINY_MOE = ModelConfig(model_type="qwen3_moe", vocab_size=512, hidden_size=128,
                       intermediate_size=256, moe_intermediate_size=64, num_experts=8,
                       num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                       rms_norm_eps=1e-6)
DATA = Path(__file__).resolve().parent / "data"


def _shape() -> bench.FileShape:
    # 4 layers of 8 experts, 10 MiB each (a layer's experts 80 MiB); 100 MiB dense.
    return bench.FileShape(num_layers=4, num_experts=8, top_k=2, dense_bytes=100 * MIB,
                           layer_expert_bytes=dict.fromkeys(range(4), 80 * MIB))


def test_a_budget_gives_both_engines_the_same_expert_bytes() -> None:
    shape = _shape()
    plan = bench.plan_budget(shape, 300 * MIB, 20 * MIB)  # 180 MiB for experts
    assert plan.expert_bytes == 180 * MIB
    assert plan.slots == 18  # 180 MiB of 10 MiB experts
    assert plan.ncmoe == 2 and plan.gpu_expert_layer_bytes == 160 * MIB  # layers 2, 3 fit
    # Room for everything: llama.cpp keeps all on the GPU; Strata's cache stays a cache.
    roomy = bench.plan_budget(shape, 2000 * MIB, 20 * MIB)
    assert roomy.ncmoe == 0 and roomy.slots == shape.total_experts - 1
    assert roomy.fits and not plan.fits  # a row where the file fits has no targets
    # No room: every layer's experts on the CPU; Strata keeps one layer's worth of slots.
    tight = bench.plan_budget(shape, 100 * MIB, 20 * MIB)
    assert tight.expert_bytes == 0 and tight.ncmoe == 4 and tight.slots == 8
    assert parse_budget("12GiB") == 12 << 30 and parse_budget("1.5MiB") == 3 << 19
    with pytest.raises(Exception, match="12GiB or 512MiB"):
        parse_budget("12G")


def test_a_budget_the_file_fits_has_no_targets() -> None:
    shape = _shape()
    plans = [bench.plan_budget(shape, b * MIB, 20 * MIB) for b in (300, 2000)]
    args = argparse.Namespace(routings=["uniform"], prefill_tokens=64)
    report = {"total_experts": shape.total_experts,
              "llamacpp": {p.label: {"decode_tok_s": 10.0, "prefill_tok_s": 100.0}
                           for p in plans},
              "strata": {p.label: {"uniform": {"decode_tok_s": 9.0, "prefill_tok_s": 90.0}}
                         for p in plans}}
    rows = {row["figure"]: row for row in bench.figures(args, plans, report)}
    tight, roomy = (p.label for p in plans)
    assert rows[f"{tight} uniform decode"]["target"] == 1.0
    assert rows[f"{tight} uniform decode"]["ok"] is False
    assert rows[f"{roomy} uniform decode"]["target"] is None
    assert rows[f"{roomy} uniform prefill 64"]["ok"] is None
    assert "the file fits" in rows[f"{roomy} uniform decode"]["notes"]


def test_llama_bench_runs_with_ncmoe_and_its_json_is_read() -> None:
    args = bench.parser().parse_args(["f.gguf", "--llama-bench", "lb", "--prefill-tokens",
                                      "256", "--decode-tokens", "8"])
    command = budget_peer.llamacpp_command(args, bench.plan_budget(_shape(), 300 * MIB, 20 * MIB))
    assert command[command.index("-ncmoe") + 1] == "2"
    assert command[command.index("-p") + 1] == "256" and command[command.index("-n") + 1] == "8"
    peer = budget_peer.parse_llama_bench("log line\n" + (DATA / "llama-bench-cpu.json").read_text(),
                                   256, 8)
    assert peer["prefill_tok_s"] == pytest.approx(671.018791)
    assert peer["decode_tok_s"] > 0 and peer["llamacpp"].startswith("0c1e570")
    with pytest.raises(ValueError, match="no result"):
        budget_peer.parse_llama_bench((DATA / "llama-bench-cpu.json").read_text(), 4096, 8)


def _fake_llama_bench(tmp_path: Path) -> Path:
    """A stand-in llama-bench (none is built here) that answers in its JSON shape and
    records its arguments: the plumbing around the real one."""
    script = tmp_path / "llama-bench"
    script.write_text(f"""#!{sys.executable}
import json, sys
args = sys.argv[1:]
open({str(tmp_path / "calls.txt")!r}, "a").write(" ".join(args) + "\\n")
p, n = int(args[args.index("-p") + 1]), int(args[args.index("-n") + 1])
print(json.dumps([{{"n_prompt": p, "n_gen": 0, "avg_ts": 100.0, "build_commit": "fake",
                   "build_number": 0, "backends": "CPU"}},
                  {{"n_prompt": 0, "n_gen": n, "avg_ts": 10.0, "build_commit": "fake",
                   "build_number": 0, "backends": "CPU"}}]))
""")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def test_the_bench_runs_end_to_end_on_the_cpu(tmp_path: Path) -> None:
    gguf = tmp_path / "tiny-moe.gguf"
    write_random_gguf(TINY_MOE, gguf, mix="F16")
    shape = bench.file_shape(gguf)
    assert (shape.num_layers, shape.num_experts, shape.top_k) == (2, 8, 2)
    # Budgets for 10 and 12 of the 16 experts, nothing reserved (the tiny model's KV is small).
    budgets = [f"{(shape.dense_bytes + n * shape.bytes_per_expert) / MIB + 0.001:.4f}MiB"
               for n in (10, 12)]
    out = tmp_path / "moe.json"
    assert bench.main([str(gguf), "--device", "cpu", "--budgets", *budgets, "--reserve-mib",
                       "0", "--decode-tokens", "12", "--warmup-tokens", "2",
                       "--prefill-tokens", "24", "--llama-bench", str(_fake_llama_bench(tmp_path)),
                       "--profile-steps", "4", "--profile-routings", "zipf", "uniform",
                       "--profile-prefill", "--shrink-pause", "--shrink-to", budgets[0],
                       "--shrink-tokens", "12", "--shrink-after", "4",
                       "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [plan["slots"] for plan in report["plans"]] == [10, 12]
    assert report["policy"] == "lfu"  # --policy lru gives the A/B against the old one
    labels = [plan["label"] for plan in report["plans"]]
    for label in labels:
        rows = report["strata"][label]
        assert rows["resize"]["num_slots"] == next(
            p["slots"] for p in report["plans"] if p["label"] == label)
        for routing in ("zipf", "uniform", "model"):
            row = rows[routing]
            assert row["tokens"] == 12 and row["decode_tok_s"] > 0 and row["prefill_tok_s"] > 0
            # What the prefill moved: the staging's traffic (none here: the CPU engine's
            # reference loop copies into slots) and its size, mapped with the slots.
            assert row["staging_bytes"] > 0 and row["prefill_staged_bytes"] >= 0
            assert row["prefill_num_staged_copy_calls"] >= 0
        # The imposed uniform trace misses (and copies experts in); the model's own routes
        # on random weights repeat, so they hit more.
        assert rows["uniform"]["hit_rate"] < 1.0
        assert rows["uniform"]["counters"]["copied_bytes"] > 0
        uniform = rows["uniform"]
        assert uniform["h2d_bytes_per_token"] == pytest.approx(
            uniform["copied_bytes_per_token"] + uniform["host_read_bytes_per_token"])
        assert 0 <= uniform["left_out_fraction"] <= 1 and uniform["copy_gb_s"] > 0
        assert uniform["copy_calls_per_token"] > 0 and rows["expert_mapped_bytes"] > 0
        # Per MoE layer, the same counters (what /v1/status's experts.layers shows).
        assert sum(row["copied_bytes"] for row in uniform["layers"].values()) == (
            uniform["counters"]["copied_bytes"])
        assert rows["model"]["hit_rate"] > rows["uniform"]["hit_rate"]
        assert report["llamacpp"][label]["decode_tok_s"] == 10.0
        # The profile under zipf: on the CPU torch.profiler lists no CUDA kernels.
        profile = rows["decode_profile"]["zipf"]
        assert profile["tokens"] == 4 and profile["wall_us_per_token"] > 0
        assert profile["warmup_tokens"] == 2 and profile["wall_unprofiled_us_per_token"] > 0
        assert rows["decode_profile"]["uniform"]["tokens"] == 4
        for routing in ("zipf", "uniform"):  # one prompt profiled after one unprofiled
            prefill = rows["prefill_profile"][routing]
            assert prefill["tokens"] == 24 and prefill["wall_unprofiled_us"] > 0
            assert prefill["wall_us"] > 0 and prefill["kernels"] == []
        assert profile["kernels"] == [] and profile["htod_share"] is None
    # Shrunk from the load's 12 slots to the first budget's 10 while the stream decoded.
    shrink = report["shrink_pause"]
    assert shrink["tokens_received"] == shrink["tokens_asked"] == 12
    assert (shrink["from_slots"], shrink["to_slots"], shrink["slots_after"]) == (12, 10, 10)
    assert 0 < shrink["median_gap_ms"] <= shrink["max_gap_ms"] < 1e6
    assert 0 < shrink["shrink_gap_ms"] <= shrink["max_gap_ms"] and shrink["resize_s"] >= 0
    assert shrink["tokens_equal_unshrunk"] is True
    calls = (tmp_path / "calls.txt").read_text().splitlines()
    assert [c.split()[c.split().index("-ncmoe") + 1] for c in calls] == [
        str(p["ncmoe"]) for p in report["plans"]]
    decode = {f["figure"]: f for f in report["figures"]}
    row = decode[f"{labels[0]} uniform decode"]
    assert row["limit"] == 10.0 and row["ratio"] == pytest.approx(row["value"] / 10.0)
    assert row["target"] == 1.0 and decode[f"{labels[0]} zipf decode"]["target"] == 1.5
    assert decode[f"{labels[0]} uniform prefill staged from host"]["unit"] == "MiB"


def test_the_shrink_row_from_every_expert_resident(tmp_path: Path) -> None:
    """--shrink-from-all: issue 54's shrink starts from an all-resident (wired) load, and the
    live switch to the partial cache loses no token and changes none."""
    gguf = tmp_path / "tiny-moe.gguf"
    write_random_gguf(TINY_MOE, gguf, mix="F16")
    shape = bench.file_shape(gguf)
    budget = f"{(shape.dense_bytes + 10 * shape.bytes_per_expert) / MIB + 0.001:.4f}MiB"
    out = tmp_path / "shrink.json"
    assert bench.main([str(gguf), "--device", "cpu", "--shrink-from-all", "--shrink-to", budget,
                       "--reserve-mib", "0", "--shrink-tokens", "12", "--shrink-after", "4",
                       "--json", str(out)]) == 0
    row = json.loads(out.read_text())["shrink_pause"]
    assert row["from_all_resident"] and row["mode_after"] == "slots"
    assert (row["from_slots"], row["to_slots"], row["slots_after"]) == (16, 10, 10)
    assert row["tokens_received"] == row["tokens_asked"] == 12
    assert row["resize"]["switched_to_slots"] and row["tokens_equal_unshrunk"] is True


def test_cpu_misses_flag_loads_strata_with_them(tmp_path: Path) -> None:
    """--cpu-misses on reaches the engine (cpu_expert_misses) and the rows carry its
    counters; the CPU engine decodes by the reference loop, which computes nothing on the
    CPU's behalf (tests/core/test_cpu_expert_misses.py covers the fast path)."""
    gguf = tmp_path / "tiny-moe.gguf"
    write_random_gguf(TINY_MOE, gguf, mix="F16")
    shape = bench.file_shape(gguf)
    budget = f"{(shape.dense_bytes + 10 * shape.bytes_per_expert) / MIB + 0.001:.4f}MiB"
    out = tmp_path / "moe.json"
    assert bench.main([str(gguf), "--device", "cpu", "--budgets", budget, "--reserve-mib", "0",
                       "--routings", "uniform", "--decode-tokens", "4", "--warmup-tokens", "1",
                       "--prefill-tokens", "24", "--cpu-misses", "on", "--cpu-preconvert",
                       "--prefetch", "2", "--prefetch-recall", "0.5", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["cpu_expert_misses"] == "on" and report["cpu_threads"] >= 1
    assert (report["prefetch"], report["prefetch_recall"]) == (2, 0.5)
    rows = report["strata"][report["plans"][0]["label"]]
    # "on" makes every expert's form as it starts (float experts: views, no bytes).
    assert rows["cpu_preconvert"]["experts"] == 16
    row = rows["uniform"]
    assert row["cpu_experts_per_token"] == 0 and row["cpu_conversions"] == 0
    assert "num_cpu_split_layers" in row["counters"] and report["cpu_miss_graphs"] is False
    # The prefetch was started for the row; the loop splits nothing, so it guessed nothing.
    assert row["prefetch"]["num_prefetched"] == 0
    # The bench reads the engine's names of the split step's host times, per token.
    from strata.engine.core.fast.moe_cpu_misses import HOST_TIMES

    assert bench.HOST_TIMES == HOST_TIMES
    assert row["split_host_ms_per_token"] == {"split_wait": 0.0, "split_host": 0.0,
                                              "join_wait": 0.0, "join_host": 0.0}
