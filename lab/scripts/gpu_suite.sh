#!/usr/bin/env bash
# The test suite on the GPU machine, failures named as they happen, then the failed tests again with tracebacks.
#   bash lab/scripts/gpu_suite.sh [seconds] [workers] [pytest selection...]   (logs under $OUT)
set -u
export PYTHONPATH=src
OUT=${OUT:-/tmp/out}
limit=${1:-480}; workers=${2:-14}; shift 2 2>/dev/null; selection=${*:-tests}
timeout "$limit" python3 -m pytest $selection -o addopts="" -n "$workers" -p no:cacheprovider -v --tb=no \
  -W ignore::pytest_benchmark.logger.PytestBenchmarkWarning 2>&1 | grep -v IndexKernelUtils > /tmp/suite.log
grep -cE " PASSED" /tmp/suite.log | sed 's/^/passed: /'
grep -E " (FAILED|ERROR)" /tmp/suite.log | sed -E 's/^\[gw[0-9]+\] \[ *[0-9]+%\] //' | sort -u > "$OUT/failed.txt"
echo "failed: $(wc -l < "$OUT/failed.txt")"; tail -2 /tmp/suite.log
cp /tmp/suite.log "$OUT/suite.log"
ids=$(sed -E 's/^(FAILED|ERROR) //; s/ - .*//' "$OUT/failed.txt" | grep "::" | head -40)
[ -n "$ids" ] && timeout 150 python3 -m pytest $ids -o addopts="" -n 8 -p no:cacheprovider -q --tb=short --maxfail=40 \
  -W ignore::pytest_benchmark.logger.PytestBenchmarkWarning > "$OUT/failed_tracebacks.log" 2>&1
true
