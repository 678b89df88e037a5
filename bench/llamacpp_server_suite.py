"""Run llama.cpp's own server tests (tools/server/tests) against a real `strata serve`.

    python bench/llamacpp_server_suite.py --tests DIR [--fresh] [--all] [--junit FILE]
                                          [--model GGUF] [--report JUNIT...] [-- PYTEST ARGS...]

DIR is a copy of llama.cpp's tools/server/tests (utils.py, conftest.py, unit/); the tests start
`llama-server` through utils.py's ServerProcess, and LLAMA_SERVER_BIN_PATH points that at
llamacpp_server_shim.py, which maps the flags to `strata serve` (default model: the cached
SmolLM2-135M, or --model). Only the model-agnostic tests run (llamacpp_suite_classes.py
says which and why; --all runs every collected test). By default one `strata serve` per flag
set is shared by the tests (a fresh one takes ~15 s to start on two cores); --fresh starts one
per test as llama.cpp's CI does. Prints `N of M model-agnostic tests pass` and the failures.
The suite's own deps: requests, pytest, openai, wget, filelock, numpy, prometheus-client.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # llamacpp_suite_classes.py
from llamacpp_suite_classes import classify

CHECKOUT = Path(__file__).resolve().parents[1]
SHIM = Path(__file__).resolve().parent / "llamacpp_server_shim.py"


def collect(tests: Path, env: dict[str, str]) -> list[str]:
    """Every test id pytest collects under DIR/unit."""
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                          "-p", "no:cacheprovider", "unit"], cwd=tests, env=env,
                         capture_output=True, text=True, check=False).stdout
    return [line.strip() for line in out.splitlines() if "::" in line]


def results(junit: Path) -> dict[str, str]:
    """test id -> passed / failed / skipped, from pytest's JUnit XML."""
    outcome = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        path = case.get("classname", "").replace(".", "/")
        test_id = f"{path}.py::{case.get('name')}"
        kinds = {child.tag for child in case}
        outcome[test_id] = ("failed" if kinds & {"failure", "error"}
                            else "skipped" if "skipped" in kinds else "passed")
    return outcome


def stop_pool(pool: Path) -> None:
    """Stop the pooled `strata serve` processes the shim started (their pids are recorded)."""
    import json
    for record in pool.glob("*.json"):
        pid = json.loads(record.read_text())["pid"]
        try:
            os.killpg(pid, signal.SIGTERM)  # started with its own session: pid is the group
        except ProcessLookupError:
            pass


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tests", type=Path, required=True, help="llama.cpp's tools/server/tests")
    p.add_argument("--model", help="GGUF to serve (default: the cached SmolLM2-135M)")
    p.add_argument("--fresh", action="store_true", help="one strata serve per test")
    p.add_argument("--all", action="store_true", help="run every test, not only agnostic ones")
    p.add_argument("--junit", type=Path, help="keep pytest's JUnit XML here")
    p.add_argument("--report", type=Path, nargs="+", help="run nothing: count earlier runs' "
                   "JUnit XML with today's classification (a later file's result wins)")
    p.add_argument("pytest_args", nargs="*")
    args = p.parse_args()
    tests = args.tests.resolve()
    work = Path(tempfile.mkdtemp(prefix="llamacpp-suite-"))
    wrapper = work / "llama-server"
    wrapper.write_text(f"#!/bin/sh\nexec '{sys.executable}' '{SHIM}' \"$@\"\n")
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "LLAMA_SERVER_BIN_PATH": str(wrapper),
           "PYTHONPATH": os.pathsep.join([str(CHECKOUT), os.environ.get("PYTHONPATH", "")]),
           "LLAMACPP_SHIM_HOME": str(work / "home")}
    if args.model:
        env["LLAMACPP_SHIM_MODEL"] = str(Path(args.model).resolve())
    if not args.fresh:
        env["LLAMACPP_SHIM_POOL"] = str(work / "pool")
    ids = collect(tests, env)
    classes = {test_id: classify(test_id) for test_id in ids}
    chosen = [t for t in ids if args.all or classes[t] is None]
    junit = args.junit.resolve() if args.junit else work / "junit.xml"
    if args.report:
        outcome = {}
        for earlier in args.report:
            outcome |= results(earlier.resolve())
    else:
        try:
            subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            "--junitxml", str(junit), *args.pytest_args, *chosen],
                           cwd=tests, env=env, check=False)
        finally:
            stop_pool(work / "pool")
        outcome = results(junit)
    print_report(ids, classes, outcome)
    shutil.rmtree(work, ignore_errors=True)
    return 0 if all(outcome.get(t) == "passed" for t in ids if classes[t] is None) else 1


def print_report(ids: list[str], classes: dict[str, str | None], outcome: dict[str, str]
                 ) -> None:
    """Per file and in all: how many model-agnostic tests passed; the ones that did not."""
    agnostic = [t for t in ids if classes[t] is None]
    passed = [t for t in agnostic if outcome.get(t) == "passed"]
    by_file: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for t in agnostic:
        by_file[t.split("::")[0]][1] += 1
        by_file[t.split("::")[0]][0] += outcome.get(t) == "passed"
    for name, (ok, total) in sorted(by_file.items()):
        print(f"{name}: {ok} of {total}")
    for t in agnostic:
        if outcome.get(t) != "passed":
            print(f"not passed ({outcome.get(t, 'not run')}): {t}")
    print(f"{len(passed)} of {len(agnostic)} model-agnostic tests pass "
          f"({len(ids) - len(agnostic)} of {len(ids)} collected are not model-agnostic)")


if __name__ == "__main__":
    sys.exit(main())
