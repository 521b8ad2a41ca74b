# W 4 in little time: the NCCL tests first, then the bench (bf16, mxfp4); a few files under $OUT
export PYTHONPATH=src:.
mkdir -p $OUT/w4 /tmp/w4
nvidia-smi -L > $OUT/w4/gpus.txt 2>&1
timeout 110 python -m pytest -q -p no:cacheprovider -rA tests/test_expert_parallel.py -k nccl > /tmp/w4/nccl.txt 2>&1
grep -E "^(PASSED|FAILED|ERROR)|passed|failed" /tmp/w4/nccl.txt > $OUT/w4/nccl_w4.txt; tail -3 $OUT/w4/nccl_w4.txt
for fmt in bf16 mxfp4; do
  timeout 80 torchrun --nproc-per-node 4 --master-port 29624 -m benchmarks.bench_moe_ep --weight-format $fmt \
    --out /tmp/w4/w4_$fmt > /tmp/w4/log_$fmt.txt 2>&1
  cat /tmp/w4/w4_$fmt/moe_ep.md >> $OUT/w4/bench_w4.md 2>/dev/null; grep "| prefill" /tmp/w4/w4_$fmt/moe_ep.md
done
