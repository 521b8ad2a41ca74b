# A/B of two trees on one two-GPU machine (run from a clean copy with the other tree unpacked in ./old):
# bench_moe_ep at --batches 1 and 4, bf16 and mxfp4. As run on 2026-11-27 (fifth session): ./ = early 3/4 at
# W 2, ./old = 13729a3 (early 1/2; 3c45095 before a history rewrite). Results in $OUT/ep_results.tgz.
mkdir -p $OUT/ep
b() {  # tree fmt batches tag
  (cd $1 && PYTHONPATH=src:. timeout 100 torchrun --nproc-per-node 2 --master-port 2962$3 -m benchmarks.bench_moe_ep \
    --weight-format $2 --batches $3 --out $OUT/ep/$4_$2_b$3 > $OUT/ep/log_$4_$2_b$3.txt 2>&1)
  grep "| prefill" $OUT/ep/$4_$2_b$3/moe_ep.md | sed "s/^/$4 $2 b$3 /"
}
b . bf16 1 new; b old bf16 1 old; b . bf16 4 new; b old bf16 4 old; b . mxfp4 1 new; b . mxfp4 4 new; b old mxfp4 1 old
cd $OUT && tar czf ep_results.tgz ep && rm -rf ep
