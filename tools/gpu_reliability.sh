#!/usr/bin/env bash
# The reliability checks that need a GPU, each under its own time limit, logs under $OUT:
#   bash tools/gpu_reliability.sh huge        tests/test_huge.py: inputs past 2^31 elements
#   bash tools/gpu_reliability.sh memcheck    compute-sanitizer memcheck over every small-shape test
#                                             (MEMCHECK_TESTS="tests/a.py tests/b.py" narrows it)
#   bash tools/gpu_reliability.sh canary      the same command on a deliberate out-of-bounds store:
#                                             must report errors (the sanitizer sees xdist workers)
#   bash tools/gpu_reliability.sh racecheck   compute-sanitizer racecheck and synccheck, one launch per kernel family
#   bash tools/gpu_reliability.sh properties  the hypothesis property tests, long profile (1000 examples each)
# PyTorch's caching allocator is off under the sanitizer, so that every tensor is its own allocation
# and a read or write past its end is reported rather than landing in a neighbour's block.
set -u
export PYTHONPATH=src
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
PYTEST="python3 -m pytest -p no:cacheprovider -rfE"
for step in "$@"; do
  case $step in
    huge)
      timeout 400 $PYTEST tests/test_huge.py -v > "$OUT/huge.log" 2>&1; tail -3 "$OUT/huge.log" ;;
    memcheck)
      PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 540 compute-sanitizer --tool memcheck --target-processes all \
        --print-limit 50 $PYTEST ${MEMCHECK_TESTS:-tests} -m "not gpu" -n 8 \
        > "$OUT/memcheck.log" 2>&1
      grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck.log" | sort | uniq -c | tail -8 ;;
    canary)
      PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 120 compute-sanitizer --tool memcheck --target-processes all \
        --print-limit 5 $PYTEST tools/sanitizer_canary.py -n 2 > "$OUT/canary.log" 2>&1
      grep -E "ERROR SUMMARY|Invalid __global__ write|passed|failed" "$OUT/canary.log" | sort | uniq -c | tail -5 ;;
    racecheck)
      # the suite is too slow under racecheck: one launch per kernel family (tools/racecheck_smoke.py),
      # compiled first without the sanitizer; then racecheck (shared-memory hazards) and synccheck
      python3 tools/racecheck_smoke.py > "$OUT/racecheck_warmup.log" 2>&1
      for tool in racecheck synccheck; do
        extra=; [ $tool = racecheck ] && extra="--racecheck-report all"
        timeout ${RACECHECK_TIMEOUT:-270} compute-sanitizer --tool $tool $extra --print-limit 50 \
          python3 tools/racecheck_smoke.py > "$OUT/$tool.log" 2>&1
        echo "$tool exit $?"; grep -E "SUMMARY|checks passed|FAIL" "$OUT/$tool.log" | tail -4
      done ;;
    properties)
      LLMK_HYPOTHESIS_PROFILE=gpu-long timeout ${PROPERTIES_TIMEOUT:-540} $PYTEST tests/test_properties.py -n 8 -v \
        --hypothesis-show-statistics ${PROPERTIES_K:+-k "$PROPERTIES_K"} \
        > "$OUT/properties_gpu_long.log" 2>&1; grep -E "PASSED|FAILED|XFAIL|passed|failed" "$OUT/properties_gpu_long.log" | tail -40 ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
