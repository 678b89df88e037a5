#!/usr/bin/env bash
# The speed issue's GPU run: parity tests, then the benchmark. Usage: bench/gpu_suite.sh OUT_DIR
# Everything (logs, bench.json) lands in OUT_DIR. Budget: at most 7 minutes on one H200
# (tests 150 s + bench 270 s; the bench itself stops starting peers at --deadline-s 250).
set -u
OUT=${1:?usage: bench/gpu_suite.sh OUT_DIR [suite.py options]}
shift
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
start=$(date +%s)
timeout 150 python -m pytest tests/gpu/test_decode_fast.py -q -rs -p no:cacheprovider \
    2>&1 | tee "$OUT/gpu_tests.log"
echo "tests rc=${PIPESTATUS[0]} after $(( $(date +%s) - start )) s" | tee -a "$OUT/gpu_tests.log"
timeout 270 python bench/suite.py --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log"
echo "bench rc=${PIPESTATUS[0]} after $(( $(date +%s) - start )) s" | tee -a "$OUT/bench.log"
