"""bench/llamacpp_batched.py reads llama-batched-bench's JSONL (the format its
tools/batched-bench prints with --output-format jsonl) and sets it against Strata's rows."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from llamacpp_batched import batched_command, parse_jsonl, ratio_rows

# Log lines around the JSONL, as the tool prints them (model load, then one object per -npl).
OUTPUT = (Path(__file__).parent / "data" / "llama-batched-bench.txt").read_text()


def test_jsonl_rows_give_the_aggregate_decode_rate_per_stream_count() -> None:
    rows = parse_jsonl(OUTPUT)
    assert sorted(rows) == [1, 4]
    assert rows[4]["aggregate_tok_s"] == 400.0 and rows[4]["prefill_tok_s"] == 10240.0
    assert rows[1]["raw"]["n_gpu_layers"] == 99


def test_ratios_are_strata_over_llamacpp_with_the_target_at_4_and_8() -> None:
    strata = [{"streams": 1, "aggregate_tok_s": 160.0}, {"streams": 4, "aggregate_tok_s": 500.0},
              {"streams": 16, "aggregate_tok_s": 900.0}]
    ratios = ratio_rows(strata, parse_jsonl(OUTPUT))
    assert [(r["streams"], r["strata_over_llamacpp"], r["target"]) for r in ratios] == [
        (1, 1.25, None), (4, 1.25, 1.2)]
    json.dumps(ratios)


def test_command_runs_every_stream_count_in_one_context_that_holds_them() -> None:
    command = batched_command("llama-batched-bench", "/m.gguf", [1, 2, 4, 8, 16], 128, 128)
    options = dict(zip(command[1::2], command[2::2]))
    assert options["-m"] == "/m.gguf" and options["-ngl"] == "99" and options["-fa"] == "1"
    assert options["-npl"] == "1,2,4,8,16" and options["-npp"] == options["-ntg"] == "128"
    assert options["--output-format"] == "jsonl"
    # Each of the 16 sequences gets context / 16 positions: its prompt and generation fit.
    assert int(options["-c"]) // 16 >= 128 + 128
