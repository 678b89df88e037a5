"""bench/llamacpp_batched.py reads llama-batched-bench's JSONL and sets it against Strata's rows.

The recorded output is a real run: llama.cpp's batched-bench built for the CPU, on a tiny
random Q4_K_M file of bench/random_gguf.py, `-npp 16 -ntg 8 -npl 1,4 --output-format jsonl`,
stdout and stderr together (the warnings before the JSON lines are part of it)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from llamacpp_batched import batched_command, parse_jsonl, ratio_rows

OUTPUT = (Path(__file__).parent / "data" / "llama-batched-bench.txt").read_text()
RECORDS = {r["pl"]: r for r in map(json.loads, (ln for ln in OUTPUT.splitlines()
                                                 if ln.startswith("{")))}


def test_jsonl_rows_give_the_aggregate_decode_rate_per_stream_count() -> None:
    rows = parse_jsonl(OUTPUT)
    assert sorted(rows) == [1, 4]
    assert rows[4]["aggregate_tok_s"] == RECORDS[4]["speed_tg"]  # 4 x 8 tokens / t_tg
    assert rows[4]["aggregate_tok_s"] == pytest.approx(4 * 8 / RECORDS[4]["t_tg"], rel=1e-3)
    assert rows[1]["prefill_tok_s"] == RECORDS[1]["speed_pp"]
    assert rows[1]["raw"]["n_gpu_layers"] == 99 and rows[1]["raw"]["flash_attn"] == 1


def test_ratios_are_strata_over_llamacpp_with_the_target_at_4_and_8() -> None:
    one, four = RECORDS[1]["speed_tg"], RECORDS[4]["speed_tg"]
    strata = [{"streams": 1, "aggregate_tok_s": 1.25 * one},
              {"streams": 4, "aggregate_tok_s": 0.5 * four},
              {"streams": 16, "aggregate_tok_s": 900.0}]  # llama.cpp ran no 16: no ratio
    ratios = ratio_rows(strata, parse_jsonl(OUTPUT))
    assert [(r["streams"], r["strata_over_llamacpp"], r["target"]) for r in ratios] == [
        (1, 1.25, None), (4, 0.5, 1.2)]
    json.dumps(ratios)


def test_command_runs_every_stream_count_in_one_context_that_holds_them() -> None:
    command = batched_command("llama-batched-bench", "/m.gguf", [1, 2, 4, 8, 16], 128, 128)
    options = dict(zip(command[1::2], command[2::2]))
    assert options["-m"] == "/m.gguf" and options["-ngl"] == "99" and options["-fa"] == "1"
    assert options["-npl"] == "1,2,4,8,16" and options["-npp"] == options["-ntg"] == "128"
    assert options["--output-format"] == "jsonl"
    # Each of the 16 sequences gets context / 16 positions: its prompt and generation fit.
    assert int(options["-c"]) // 16 >= 128 + 128
