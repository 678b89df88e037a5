#!/usr/bin/env bash
# The speed issue's GPU run: parity tests, the decode profile, then the benchmark.
# Usage: bench/gpu_suite.sh OUT_DIR [suite.py options]. Everything (logs, bench.json) lands in
# OUT_DIR. Budget: at most 6 minutes on one H200 (tests 100 s + profile 50 s + bench 210 s;
# the bench itself stops starting peers at --deadline-s 190).
set -u
OUT=${1:?usage: bench/gpu_suite.sh OUT_DIR [suite.py options]}
shift
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
start=$(date +%s)
timeout 100 python -m pytest tests/gpu/test_decode_fast.py -q -rs -p no:cacheprovider \
    2>&1 | tee "$OUT/gpu_tests.log"
echo "tests rc=${PIPESTATUS[0]} after $(( $(date +%s) - start )) s" | tee -a "$OUT/gpu_tests.log"
# Per-kernel CUDA time of one decode step (qwen3-30b-a3b first, then llama3-8b) and one MoE prefill.
timeout 50 python bench/profile_decode.py --steps 8 --prefill-tokens 4096 \
    2>&1 | tee "$OUT/profile.log"
echo "profile rc=${PIPESTATUS[0]} after $(( $(date +%s) - start )) s" | tee -a "$OUT/profile.log"
timeout 210 python bench/suite.py --out "$OUT" --deadline-s 190 "$@" 2>&1 | tee "$OUT/bench.log"
echo "bench rc=${PIPESTATUS[0]} after $(( $(date +%s) - start )) s" | tee -a "$OUT/bench.log"
