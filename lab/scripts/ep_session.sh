#!/bin/bash
# One multi-GPU device call for the expert-parallel work: topology, profiles of one forward at 2 and W ranks
# (and the one-GPU block), then bench_moe_ep at W ranks (and 2 when W > 2). Results under $OUT.
# Usage (repository root of a clean copy, PYTHONPATH=src:.): bash lab/scripts/ep_session.sh [W] [parts...]
W=${1:-4}; shift; PARTS=${*:-"profile bench"}
nvidia-smi topo -m > $OUT/topo.txt 2>&1
run() { echo "== $*"; timeout ${LIMIT:-300} "$@"; echo "rc=$?"; }
for part in $PARTS; do
  case $part in
    profile)
      CUDA_VISIBLE_DEVICES=0,1 run torchrun --nproc-per-node 2 --master-port 29611 lab/scripts/profile_moe_ep.py --one-gpu > $OUT/prof_w2.txt 2>&1
      [ $W -gt 2 ] && run torchrun --nproc-per-node $W --master-port 29612 lab/scripts/profile_moe_ep.py > $OUT/prof_w$W.txt 2>&1 ;;
    bench)
      for fmt in mxfp4 bf16; do
        run torchrun --nproc-per-node $W --master-port 29613 -m benchmarks.bench_moe_ep --weight-format $fmt --micro-batches 1 2 --out $OUT/w${W}_$fmt > $OUT/bench_w${W}_$fmt.txt 2>&1
      done ;;
    bench2)
      for fmt in mxfp4 bf16; do
        CUDA_VISIBLE_DEVICES=0,1 run torchrun --nproc-per-node 2 --master-port 29614 -m benchmarks.bench_moe_ep --weight-format $fmt --out $OUT/w2_$fmt > $OUT/bench_w2_$fmt.txt 2>&1
      done ;;
    nccl)
      run python -m pytest -q -p no:cacheprovider -rA tests/test_expert_parallel.py -k nccl > $OUT/nccl_tests.txt 2>&1 ;;
  esac
done
tail -5 $OUT/*.txt
