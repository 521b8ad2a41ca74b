#!/usr/bin/env bash
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
M=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum,sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,launch__grid_size,launch__block_size,launch__occupancy_limit_registers,launch__occupancy_limit_shared_mem,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__throughput.avg.pct_of_peak_sustained_elapsed
timeout 240 ncu --metrics $M -k regex:"attention|combine|cudnn|fmha|sm90|xmma|flash|sdpa" --launch-skip 3 --launch-count 6 python3 .session/ncu_decode.py > $OUT/ncu_decode_b1_8k.txt 2>&1
grep -E "^  [a-zA-Z_].*\(|gpu__time|dram__|warps_active|registers|grid_size|block_size|occupancy|long_score|issue_active|sm__throughput" $OUT/ncu_decode_b1_8k.txt | cut -c1-160 | head -80
