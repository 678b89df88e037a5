"""bench/diag_dequant.py without a GPU: it imports, and its arguments parse."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as QT

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import diag_dequant


def test_defaults_cover_the_issue_s_types_shapes_and_token_counts() -> None:
    args = diag_dequant.parse_args([])
    assert args.part == "both" and args.out is None
    assert {QT.Q4_K, QT.Q6_K, QT.Q8_0, QT.Q5_K, QT.Q4_0, QT.IQ2_XXS} <= set(args.types)
    assert args.moe_types == [QT.Q4_K, QT.Q4_K, QT.Q6_K]
    assert {512, 1024, 2048, 4096} <= set(args.tokens)
    assert {name for name, *_ in diag_dequant.SHAPES} >= {"8b.gate_up", "30b.down"}


def test_arguments_parse_and_bad_ones_are_refused(tmp_path) -> None:
    args = diag_dequant.parse_args(["--part", "moe", "--types", "Q5_1", "--tokens", "64,512",
                                    "--out", str(tmp_path / "x.json")])
    assert (args.part, args.types, args.tokens) == ("moe", [QT.Q5_1], [64, 512])
    assert args.out == tmp_path / "x.json"
    with pytest.raises(SystemExit):
        diag_dequant.parse_args(["--moe-types", "Q4_K,Q6_K"])
    with pytest.raises(SystemExit):
        diag_dequant.parse_args(["--tokens", "0"])
