#!/usr/bin/env bash
# The whole GPU test suite on one H200, in two device calls (one call's 600 s holds either):
#   bench/gpu_tests.sh OUT_DIR parallel   # every file but the NVML ones, WORKERS at a time
#                                         # (default 8; run 32c: 246 tests in 437 s)
#   bench/gpu_tests.sh OUT_DIR serial     # files that read device-wide free VRAM (NVML,
#                                         # mem_get_info), one at a time (run 32b: 322 s)
# Each test is named as it ends (-v), so a call cut short by its time limit still says which
# tests failed; tracebacks print at the end, so rerun those alone with --tb=long.
# Needs the test requirements: pytest-xdist, pytest-asyncio (pytest-aiohttp brings it) for
# the async files, jsonschema for the constrained-output checks; without one of them those
# tests fail or do not collect (run 30b), so the script refuses to start.
set -u
OUT=${1:?usage: bench/gpu_tests.sh OUT_DIR parallel|serial [timeout_s]}
PART=${2:?usage: bench/gpu_tests.sh OUT_DIR parallel|serial [timeout_s]}
LIMIT_S=${3:-540}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
for module in xdist pytest_asyncio jsonschema; do
  python -c "import $module" 2>/dev/null || {
    echo "gpu_tests.sh: python cannot import $module; install the test requirements" \
         "(pip install -e '.[dev]', or carry their wheels to the device)" >&2; exit 2; }
done
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
SERIAL=(tests/gpu/test_arena_cuda.py tests/gpu/test_engine_levels_cuda.py
        tests/gpu/test_model_pool_cuda.py tests/gpu/test_game_scenario_cuda.py)
case "$PART" in
  parallel)
    ignore=()
    for f in "${SERIAL[@]}"; do ignore+=("--ignore=$f"); done
    args=(-n "${WORKERS:-8}" --dist loadfile --max-worker-restart=0 tests/gpu "${ignore[@]}") ;;
  serial) args=("${SERIAL[@]}") ;;
  *) echo "the part is parallel or serial, not $PART" >&2; exit 2 ;;
esac
# run_group.sh, not timeout: a cut run's xdist workers would keep the GPU busy.
bench/run_group.sh "$LIMIT_S" python -m pytest -v -ra -p no:cacheprovider "${args[@]}" \
    --junitxml="$OUT/gpu-tests-$PART.xml" > "$OUT/gpu-tests-$PART.log" 2>&1
echo "rc=$?" >> "$OUT/gpu-tests-$PART.log"
grep -hE "FAILED|ERROR|passed|failed|^rc=" "$OUT/gpu-tests-$PART.log" | tail -40
