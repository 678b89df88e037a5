"""bench/diag_staging_gather.py on the CPU: the staging's gather runs, lands a direct index's
bytes (the script checks), and the report names the element type it moved."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import diag_staging_gather


def test_the_gather_diagnostic_runs_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "gather.json"
    # 40 experts: two groups of GATHER_EXPERTS (32) and a part; 1000-byte projections.
    assert diag_staging_gather.main(["--device", "cpu", "--slots", "64", "--expert-bytes",
                                     "3000", "--experts", "40", "--repeats", "1",
                                     "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["moved_bytes"] == 40 * 3000
    assert report["element"] == "torch.int64"  # 1000 bytes a row: eight divides
    assert report["gather_gb_s"] > 0 and report["copy_gb_s"] > 0
