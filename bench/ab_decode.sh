#!/usr/bin/env bash
# A decode A/B of two source trees in one device call, on the same seeded GGUF files:
#   bench/ab_decode.sh OUT MAIN_TREE BRANCH_TREE [MODEL...]
# MODEL: 8b (Llama-3-8B-shaped Q4_K_M), moe (Qwen3-30B-A3B-shaped Q4_K_M), or a .gguf path;
# default: 8b moe. MAIN_TREE is the base as files, e.g.
#   git archive REV strata bench tests/helpers pyproject.toml | tar -x -C .ab/main
# (the device gets no git history), carried to the device with the branch's checkout.
#
# The trees take turns, main first, ROUNDS times (default 2), on one Triton cache. The
# branch runs on the dp4a tiles main's first run recorded (quant_bench --pin-tiles): a tree
# that edits a file holding those kernels re-keys their tuning, and its GEMVs may land on
# other tiles, which moved run 30's 8B by as much as the change measured
# (docs/benchmarks.md, run 30). PIN=0 lets the branch tune its own (a branch that changes
# the candidates needs it). The first round also profiles (PROFILE_STEPS, default 4; 0: off).
# BENCH_ARGS replaces the decode-only quant_bench arguments below; a run is cut at RUN_S
# seconds (default 200). Writes OUT/summary.txt, one line a run, and each run's JSON and log.
set -u
OUT=${1:?usage: bench/ab_decode.sh OUT MAIN_TREE BRANCH_TREE [MODEL...]}
MAIN=$(cd "${2:?main tree}" && pwd) || exit 2
BRANCH=$(cd "${3:?branch tree}" && pwd) || exit 2
shift 3
MODELS=("$@")
[ ${#MODELS[@]} -eq 0 ] && MODELS=(8b moe)
ROUNDS=${ROUNDS:-2}
PIN=${PIN:-1}
PROFILE_STEPS=${PROFILE_STEPS:-4}
RUN_S=${RUN_S:-200}
BENCH_ARGS=${BENCH_ARGS:-"--decode-tokens 64 --prefill-tokens 512 --ttft-tokens 512 --repeats 3 --cycles 0 --no-reload"}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
for tree in "$MAIN" "$BRANCH"; do
  [ -f "$tree/bench/quant_bench.py" ] || { echo "ab_decode.sh: $tree has no bench/quant_bench.py" >&2; exit 2; }
done

declare -A FILES SHAPES
for m in "${MODELS[@]}"; do  # every argument checked before anything runs
  case $m in
    8b) FILES[$m]=/dev/shm/ab-8b.gguf; SHAPES[$m]=llama3-8b ;;
    moe) FILES[$m]=/dev/shm/ab-moe.gguf; SHAPES[$m]=qwen3-30b-a3b ;;
    *.gguf) [ -f "$m" ] || { echo "ab_decode.sh: no file $m" >&2; exit 2; }
            FILES[$m]=$m ;;
    *) echo "ab_decode.sh: a model is 8b, moe or a .gguf path, not $m" >&2; exit 2 ;;
  esac
done
for m in "${MODELS[@]}"; do
  if [ ! -f "${FILES[$m]}" ]; then  # seeded: every call writes the same bytes
    PYTHONPATH="$BRANCH${PYTHONPATH:+:$PYTHONPATH}" python3 "$BRANCH/bench/random_gguf.py" \
      "${SHAPES[$m]}" "${FILES[$m]}" --type Q4_K_M > "$OUT/gen-$m.log" 2>&1 &
  fi
done
wait

has_tiles() {  # the JSON records dp4a tiles (a CUDA run since run 30)
  python3 -c "import json,sys; sys.exit(0 if json.load(open(sys.argv[1])).get('strata', {}).get('dp4a_tiles') else 1)" "$1" 2>/dev/null
}

for m in "${MODELS[@]}"; do
  label=$(basename "$m" .gguf)
  for round in $(seq 1 "$ROUNDS"); do
    for side in main branch; do
      tree=$MAIN; [ $side = branch ] && tree=$BRANCH
      name="quant-$label-$side-$round"
      args=($BENCH_ARGS --json "$OUT/$name.json")
      [ "$round" = 1 ] && [ "$PROFILE_STEPS" != 0 ] && args+=(--profile-steps "$PROFILE_STEPS")
      pinned=""
      first_main="$OUT/quant-$label-main-1.json"
      if [ $side = branch ] && [ "$PIN" = 1 ] && has_tiles "$first_main"; then
        args+=(--pin-tiles "$first_main"); pinned=" (main's tiles)"
      fi
      PYTHONPATH="$tree${PYTHONPATH:+:$PYTHONPATH}" timeout "$RUN_S" python3 "$tree/bench/quant_bench.py" \
        "${FILES[$m]}" "${args[@]}" > "$OUT/$name.log" 2>&1
      rc=$?
      decode=$(grep -h "decode bs1" "$OUT/$name.log" | tail -1 | awk '{for (i = 2; i <= NF; i++) if ($i == "tok/s") print $(i-1), $i}')
      echo "$label round $round $side$pinned rc=$rc decode ${decode:-none} t=${SECONDS}s" | tee -a "$OUT/summary.txt"
    done
  done
done
