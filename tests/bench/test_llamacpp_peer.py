"""bench/llamacpp_peer.py reads llama-bench's JSON: the figures a real llama-bench run wrote
(llama.cpp 0c1e570 built for the CPU by bench/build_llamacpp.sh, on the random SmolLM2 GGUF
of bench/random_gguf.py) become the peer's decode, prefill and time-to-first-token."""

from __future__ import annotations

import json
import sys
from argparse import Namespace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from llamacpp_peer import bench_command, parse_results

RECORDED = Path(__file__).parent / "data" / "llama-bench-cpu.json"
ARGS = Namespace(llama_bench="llama-bench", prefill_tokens=256, prompt_tokens=64,
                 decode_tokens=8, gpu_layers=0, ubatch=2048)


def test_recorded_llama_bench_output_gives_the_peer_figures() -> None:
    text = RECORDED.read_text()
    tests = {(t["n_prompt"], t["n_gen"]): t for t in json.loads(text)}
    result = parse_results("build: 0c1e570\n" + text, ARGS)  # anything before the list is skipped
    assert result["decode_tok_s"] == tests[(0, 8)]["avg_ts"]
    assert result["prefill_tok_s"] == tests[(256, 0)]["avg_ts"]
    assert result["ttft_ms"] == pytest.approx(64 / tests[(64, 0)]["avg_ts"] * 1e3)
    assert result["llamacpp"].startswith("0c1e570") and result["backends"] == "CPU"


def test_a_missing_test_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"no result for \(prompt, generated\) \[\(4096, 0\)\]"):
        parse_results(RECORDED.read_text(), Namespace(**{**vars(ARGS), "prefill_tokens": 4096}))


def test_command_asks_for_every_figure_parse_results_reads() -> None:
    command = bench_command(ARGS, Path("/models/m.gguf"))
    assert command[:3] == ["llama-bench", "-m", "/models/m.gguf"]
    options = dict(zip(command[3::2], command[4::2]))
    assert options["-p"] == "256,64" and options["-n"] == "8" and options["-o"] == "json"
    assert options["-ngl"] == "0" and options["-fa"] == "1"
