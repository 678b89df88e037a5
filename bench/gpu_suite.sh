#!/usr/bin/env bash
# The speed issue's GPU run: parity tests, the decode profile, then the benchmark.
# Usage: [LLAMA_BENCH=BIN | LLAMACPP_SRC=DIR|TGZ] bench/gpu_suite.sh OUT_DIR [suite.py options].
# LLAMA_BENCH: a llama-bench built elsewhere (bench/build_llamacpp.sh with CUDA_ROOT). Everything
# (logs, bench.json) lands in OUT_DIR. Budget: at most 6 minutes on one H200 (tests 100 s +
# profile 50 s + bench 210 s; the bench stops starting peers at --deadline-s 190); with
# LLAMACPP_SRC, plus the llama.cpp build and up to 9 minutes for the bench and both peers.
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
# llama.cpp as a second peer when LLAMACPP_SRC names its source (a directory or a .tar.gz
# holding llama.cpp/): built for Hopper first, several minutes (bench/build_llamacpp.sh).
peer=(--deadline-s 190)
suite_timeout_s=210
bench=${LLAMA_BENCH:-}
if [ -z "$bench" ] && [ -n "${LLAMACPP_SRC:-}" ]; then
  src=$LLAMACPP_SRC
  if [ -f "$src" ]; then mkdir -p /tmp/llamacpp-src && tar xzf "$src" -C /tmp/llamacpp-src && src=/tmp/llamacpp-src/llama.cpp; fi
  bench=$(bash bench/build_llamacpp.sh "$src" /tmp/llamacpp-build cuda 2>&1 | tee "$OUT/llamacpp_build.log" | tail -1)
  echo "llama.cpp build after $(( $(date +%s) - start )) s: $bench" | tee -a "$OUT/llamacpp_build.log"
fi
if [ -n "$bench" ] && [ -x "$bench" ]; then  # an 8B GGUF takes a minute or two to write
  peer=(--deadline-s 520 --llama-bench "$bench" --llamacpp-timeout-s 240)
  suite_timeout_s=540
fi
# The lifecycle rows have their own script and budget: bench/lifecycle_bench.py, unload_bench.py.
timeout "$suite_timeout_s" python bench/suite.py --out "$OUT" --no-lifecycle "${peer[@]}" "$@" \
    2>&1 | tee "$OUT/bench.log"
echo "bench rc=${PIPESTATUS[0]} after $(( $(date +%s) - start )) s" | tee -a "$OUT/bench.log"
