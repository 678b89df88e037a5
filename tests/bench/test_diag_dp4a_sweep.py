"""bench/diag_dp4a_sweep.py without a GPU: its tiles keep gemv_dp4a's whole-groups rule, its
arguments parse, timed calls take turns over copies of the weight, and through Triton's CPU
interpreter a tile launched directly multiplies like the tuned kernel."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import diag_dp4a_sweep
from gguf import GGMLQuantizationType as QT

from strata.engine.core.quant import gemv_dp4a
from strata.engine.core.quant.dp4a_dots import GROUP_VALUES


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q6_K, QT.IQ2_XXS])
def test_tiles_are_the_tuned_candidates_and_grid_tiles_of_whole_groups(qtype) -> None:
    candidates = set(gemv_dp4a.CONFIGS[int(qtype)])
    small = diag_dp4a_sweep.tiles(int(qtype), "small")
    full = diag_dp4a_sweep.tiles(int(qtype), "full")
    assert candidates < set(small) < set(full)
    for rows, cols, warps, _ in set(full) - candidates:
        groups_a_thread = rows * cols / GROUP_VALUES[int(qtype)] / (32 * warps)
        assert 1 <= groups_a_thread <= diag_dp4a_sweep.MAX_GROUPS_A_THREAD


def test_arguments_parse_and_bad_ones_are_refused() -> None:
    args = diag_dp4a_sweep.parse_args(["--types", "Q8_0,IQ2_XXS", "--shapes", "down"])
    assert (args.types, args.shapes, args.grid) == ([int(QT.Q8_0), int(QT.IQ2_XXS)], ["down"],
                                                    "small")
    for bad in (["--types", "Q2_K"], ["--types", "Q9_K"], ["--shapes", "lm"],
                ["--grid", "huge"], ["--cold-mib", "-1"]):
        with pytest.raises(SystemExit):
            diag_dp4a_sweep.parse_args(bad)


def test_timed_calls_take_turns_over_copies_that_hold_the_cold_bytes() -> None:
    raw = torch.arange(10, dtype=torch.uint8)
    assert len(diag_dp4a_sweep.cold_copies(raw, 0)) == 1
    copies = diag_dp4a_sweep.cold_copies(raw, 25)
    assert len(copies) == 3 and copies[0] is raw
    assert len({c.data_ptr() for c in copies}) == 3
    assert all(torch.equal(c, raw) for c in copies)
    seen = []
    call = diag_dp4a_sweep.taking_turns(lambda w: seen.append(w.data_ptr()), copies)
    for _ in range(7):
        call()
    assert seen == [c.data_ptr() for c in copies * 3][:7]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="Triton CPU interpreter not enabled")
@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q6_K])
def test_a_tile_launched_directly_multiplies_like_the_tuned_kernel(qtype) -> None:
    torch.manual_seed(0)
    rows = diag_dp4a_sweep.sweep(int(qtype), (12, 768), [(4, 256, 2, 1), (8, 512, 4, 1)],
                                 diag_dp4a_sweep.wall_time_us, "cpu", cold_bytes=20_000)
    assert rows[0]["tile"].startswith("tuned") and len(rows) == 3
    for row in rows[1:]:
        assert "error" not in row, row
        assert row["us"] > 0 and row["blocks_gb_s"] > 0
        assert row["rel_diff"] < diag_dp4a_sweep.MAX_REL_DIFF, row
