#!/usr/bin/env bash
# One device call that checks and measures everything: the whole test suite on the GPU, the demo,
# the MoE example, and the benchmarks, each under its own time limit, all output under $OUT
# (tarred per benchmark so that every file comes back).
#   bash benchmarks/gpu_session.sh [tests|bench|all]   (default all)
set -u
export PYTHONPATH=src
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
what=${1:-all}
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
if [ "$what" != bench ]; then
  timeout 330 python3 -m pytest tests -n 6 -p no:cacheprovider --timeout 300 -rfE \
    -W ignore::pytest_benchmark.logger.PytestBenchmarkWarning 2>&1 | grep -v IndexKernelUtils > "$OUT/pytest_full_suite.log"
  tail -3 "$OUT/pytest_full_suite.log"
  timeout 120 python3 -m llmkernels demo > "$OUT/demo.log" 2>&1; tail -2 "$OUT/demo.log"
  timeout 300 python3 examples/moe_transformer_block.py > "$OUT/example_moe_block.log" 2>&1; tail -2 "$OUT/example_moe_block.log"
fi
if [ "$what" != tests ]; then
  for bench in bench_grouped_matmul bench_moe_layer bench_attention; do
    mkdir -p "/tmp/$bench"
    timeout 420 python3 -m benchmarks "$bench" --out "/tmp/$bench" > "/tmp/$bench/stdout.log" 2>&1
    tail -2 "/tmp/$bench/stdout.log"
    tar czf "$OUT/$bench.tgz" -C /tmp "$bench"
  done
fi
