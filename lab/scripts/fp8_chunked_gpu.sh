#!/bin/bash
# One device call (H100): the FP8 prefill's GPU tests (paged / ragged / bf16 q / D 256 / windows), the bf16 Gluon
# prefill's (its K/V loads take a column now), the FP8 prefill and chunked-prefill benches, the lab kernel's softmax
# variants (variants, not run yet). Results in $OUT.
# Run from a clean tree copy: cd .clean && bash lab/scripts/fp8_chunked_gpu.sh [tests] [prefill] [chunked]
set -u
export PYTHONPATH=src:.:/tmp/cfe
pip install -q --no-deps --target /tmp/cfe .whl/*.whl >/dev/null 2>&1
parts="${*:-tests prefill chunked}"
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
for part in $parts; do
  start=$(date +%s)
  case $part in
    tests)
      timeout ${TESTS_LIMIT:-300} python -m pytest -n 8 -q -rP -p no:cacheprovider tests/test_gluon_fp8_attention.py \
        ${TEST_FILES:-tests/test_attention_fp8.py tests/test_gluon_hopper_attention.py} > $OUT/tests.log 2>&1
      grep -E "out rel|passed|failed|FAILED|Error" $OUT/tests.log | tail -60 ;;
    prefill)
      timeout ${PREFILL_LIMIT:-170} python -m benchmarks bench_attention_prefill --fp8 --out $OUT/prefill_fp8 2>&1 | tail -25 ;;
    variants)
      timeout ${VARIANTS_LIMIT:-220} python lab/gluon_fp8_attention/time_variants.py --timeout 90 2>&1 | tail -8 ;;
    chunked)
      timeout ${CHUNKED_LIMIT:-160} python -m benchmarks bench_attention_chunked --fp8 --budget ${BUDGET:-110} \
        --out $OUT/chunked_fp8 2>&1 | tail -25 ;;
  esac
  echo "== $part: $(( $(date +%s) - start )) s"
done
cd $OUT && tar czf results.tgz $(ls -d prefill_fp8 chunked_fp8 2>/dev/null) 2>/dev/null; ls $OUT
