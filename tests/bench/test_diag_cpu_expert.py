"""bench/diag_cpu_expert.py on the CPU: Q4_K converts exactly to torch's int4 groups (and a
wrong convention is caught), and the script runs end to end on a reduced shape."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as QT

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import diag_cpu_expert
from cpu_expert_formats import Int4Groups, dequantized, q4k_to_int4

EXACT = 1e-6  # relative to max |w|: float32 rounding of scale and zero, nothing more
BF16_SCALES = 1e-2  # bf16 keeps 8 bits of each scale and zero


def _q4k(rows: int, cols: int, seed: int):
    blocks = diag_cpu_expert.random_matrix(QT.Q4_K, rows, cols, seed)
    return q4k_to_int4(blocks, rows, cols), dequantized(blocks, QT.Q4_K, rows, cols)


def test_q4k_is_exactly_torch_s_int4_groups_through_the_kernel() -> None:
    groups, exact = _q4k(96, 512, seed=3)
    assert float((groups.dequantize() - exact).abs().max() / exact.abs().max()) < EXACT
    assert diag_cpu_expert.convention_error(groups, exact, seed=0) < EXACT
    assert diag_cpu_expert.bf16_scale_error(groups, exact) < BF16_SCALES


@pytest.mark.parametrize("wrong", ["zero sign", "nibble order", "zero without the 8"])
def test_a_wrong_convention_is_caught(wrong: str) -> None:
    groups, exact = _q4k(96, 512, seed=4)
    codes, scales, zeros = groups.codes, groups.scales, groups.zeros
    if wrong == "zero sign":
        broken = Int4Groups(codes, scales, -zeros)
    elif wrong == "nibble order":  # high nibbles first in each 64-value chunk
        swapped = codes.view(96, -1, 2, 32).flip(2).reshape(96, 512).contiguous()
        broken = Int4Groups(swapped, scales, zeros)
    else:  # the min alone, as if the kernel did not centre the nibble at 8
        broken = Int4Groups(codes, scales, zeros - 8 * scales)
    assert diag_cpu_expert.convention_error(broken, exact, seed=0) > 1e-2


def test_the_script_runs_on_a_reduced_shape(tmp_path) -> None:
    out = tmp_path / "cpu-expert.json"
    torch_threads = torch.get_num_threads()
    try:
        assert diag_cpu_expert.main(["--hidden", "256", "--inter", "256", "--threads", "1",
                                     "--tokens", "1,2", "--down-types", "Q6_K,Q4_K",
                                     "--min-time-s", "0.01", "--json", str(out)]) == 0
    finally:
        torch.set_num_threads(torch_threads)
    report = json.loads(out.read_text())
    q6k, q4k = report["experts"]["Q6_K"], report["experts"]["Q4_K"]
    for name in ("gate", "up"):
        assert q6k["errors"][f"{name}_int4_kernel_f32"] < EXACT
        assert q6k["errors"][f"{name}_int4_bf16_scales"] < BF16_SCALES
    assert q4k["errors"]["down_int4_kernel_f32"] < EXACT
    assert 0 < q6k["errors"]["down_int8_max"] < 1e-2  # requantized: lossy, but 8 bits
    for expert in (q6k, q4k):
        assert expert["errors"]["ffn_int4"] < 5e-2 and expert["errors"]["ffn_bf16"] < 5e-2
    # 256 x 256 a matrix: 256 blocks; Q4_K blocks are 144 bytes, Q6_K 210.
    assert q6k["bytes"] == {"gguf": 2 * 256 * 144 + 256 * 210,
                            "int4": 2 * (256 * 128 + 4 * 256 * 8) + 256 * 256 + 2 * 256,
                            "bf16": 6 * 256 * 256}
    assert [(r["down"], r["path"], r["tokens"]) for r in report["rows"]] == [
        (d, p, t) for d in ("Q6_K", "Q4_K") for t in (1, 2) for p in ("int4", "bf16")]
    assert all(r["us"] > 0 and r["threads"] == 1 for r in report["rows"])


def test_bad_arguments_are_refused() -> None:
    args = diag_cpu_expert.parse_args(["--threads", "1,2,4,8,16", "--down-types", "Q8_0"])
    assert (args.threads, args.down_types) == ([1, 2, 4, 8, 16], [QT.Q8_0])
    for bad in (["--down-types", "Q5_K"], ["--threads", "0"], ["--hidden", "300"]):
        with pytest.raises(SystemExit):
            diag_cpu_expert.parse_args(bad)
