"""bench/ab_decode.sh, the decode A/B of two trees: the trees take turns on the same file,
the branch on the dp4a tiles main's first run recorded, and bad arguments stop it with one
line. A real quant_bench runs on the CPU (no tiles there, so nothing is pinned); a stand-in
tree whose quant_bench records tiles shows the branch getting main's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "ab_decode.sh"
CPU_ARGS = ("--device cpu --decode-tokens 2 --prefill-tokens 16 --ttft-tokens 16 --repeats 1 "
            "--no-reload")
# A tree's quant_bench that prints its arguments and records tiles, as a CUDA run does.
STAND_IN = """import json, sys
args = sys.argv[1:]
out = args[args.index("--json") + 1]
json.dump({"strata": {"dp4a_tiles": {"_dp4a_kernel type 12": {"(1,)": "t"}}}}, open(out, "w"))
print("args", " ".join(args))
print("x decode bs1 123.45 tok/s")
"""


def _run(out: Path, main: Path, branch: Path, *models: str, **env: str):
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "ROUNDS": "1", **env}
    full_env["PATH"] = f"{Path(sys.executable).parent}:{full_env['PATH']}"  # python3: ours
    return subprocess.run(["bash", str(SCRIPT), str(out), str(main), str(branch), *models],
                          capture_output=True, text=True, timeout=300, env=full_env)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    sys.path.insert(0, str(ROOT / "bench"))
    from random_gguf import write_random_gguf

    path = tmp_path_factory.mktemp("ab") / "tiny.gguf"
    write_random_gguf("smollm2-135m", path, mix="Q8_0", num_layers=2)
    return path


def test_both_trees_run_on_the_same_file_and_say_so(tmp_path: Path, tiny_gguf: Path) -> None:
    done = _run(tmp_path / "out", ROOT, ROOT, str(tiny_gguf), BENCH_ARGS=CPU_ARGS,
                PROFILE_STEPS="0")
    assert done.returncode == 0, done.stderr
    lines = (tmp_path / "out" / "summary.txt").read_text().splitlines()
    assert [line.split(" rc=")[0] for line in lines] == ["tiny round 1 main",
                                                        "tiny round 1 branch"]
    assert all(" rc=0 decode " in line and " tok/s " in line for line in lines)
    for side in ("main", "branch"):
        assert (tmp_path / "out" / f"quant-tiny-{side}-1.json").stat().st_size > 0


def _stand_in_tree(path: Path) -> Path:
    (path / "bench").mkdir(parents=True)
    (path / "bench" / "quant_bench.py").write_text(STAND_IN)
    return path


def test_the_branch_runs_on_the_tiles_main_recorded(tmp_path: Path, tiny_gguf: Path) -> None:
    main, branch = _stand_in_tree(tmp_path / "main"), _stand_in_tree(tmp_path / "branch")
    done = _run(tmp_path / "out", main, branch, str(tiny_gguf), PROFILE_STEPS="0")
    assert done.returncode == 0, done.stderr
    first = tmp_path / "out" / "quant-tiny-main-1.json"
    assert "--pin-tiles" not in (tmp_path / "out" / "quant-tiny-main-1.log").read_text()
    assert f"--pin-tiles {first}" in (tmp_path / "out" / "quant-tiny-branch-1.log").read_text()
    assert "branch (main's tiles) rc=0 decode 123.45 tok/s" in done.stdout
    unpinned = _run(tmp_path / "out2", main, branch, str(tiny_gguf), PIN="0")
    assert "--pin-tiles" not in (tmp_path / "out2" / "quant-tiny-branch-1.log").read_text()
    assert "--profile-steps 4" in (tmp_path / "out2" / "quant-tiny-branch-1.log").read_text()
    assert unpinned.returncode == 0


def test_bad_arguments_stop_it_with_one_line(tmp_path: Path) -> None:
    done = _run(tmp_path / "out", ROOT, ROOT, "8b", "7b")  # checked before 8b's file is made
    assert done.returncode == 2 and "a model is 8b, moe or a .gguf path, not 7b" in done.stderr
    done = _run(tmp_path / "out", ROOT, tmp_path, "8b")
    assert done.returncode == 2 and "has no bench/quant_bench.py" in done.stderr
    assert not (tmp_path / "out" / "summary.txt").exists()
