#!/bin/bash
# Second multi-GPU call: the exchange's overlap against NCCL's SM use. bench_moe_ep at W = 4 and 2, kept-first on /
# off, 1 / 2 micro-batches, NCCL's default channels and NCCL_MAX_NCHANNELS=8; then the NCCL tests at W = 4.
W=${1:-4}
run() { echo "== $*"; timeout ${LIMIT:-240} "$@"; echo "rc=$?"; }
nvidia-smi topo -m > $OUT/topo.txt 2>&1
for fmt in mxfp4 bf16; do
  run torchrun --nproc-per-node $W --master-port 29621 -m benchmarks.bench_moe_ep --weight-format $fmt --micro-batches 1 2 --kept-first on off --out $OUT/w${W}_$fmt > $OUT/log_w${W}_$fmt.txt 2>&1
  NCCL_MAX_NCHANNELS=8 run torchrun --nproc-per-node $W --master-port 29622 -m benchmarks.bench_moe_ep --weight-format $fmt --micro-batches 1 2 --kept-first on off --out $OUT/w${W}_${fmt}_nch8 > $OUT/log_w${W}_${fmt}_nch8.txt 2>&1
  CUDA_VISIBLE_DEVICES=0,1 run torchrun --nproc-per-node 2 --master-port 29623 -m benchmarks.bench_moe_ep --weight-format $fmt --kept-first on off --out $OUT/w2_$fmt > $OUT/log_w2_$fmt.txt 2>&1
done
for f in $OUT/w*/moe_ep.md; do echo "### $f"; grep -E "prefill|all_to_all|\| decode \| +\| +\| +\| 1 " $f; done
cd $OUT && tar czf ep_results.tgz w* log_* topo.txt && rm -rf w* log_* topo.txt
