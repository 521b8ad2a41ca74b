#!/bin/bash
# One multi-GPU device call for the expert-parallel work (repository root of a clean copy, PYTHONPATH=src:.):
#   bash lab/scripts/ep_session.sh W [parts...]      parts: bench bench2 old old2 nccl nccl2 profile profile2
#                                                    (default: bench bench2 nccl)
# bench: bench_moe_ep at W ranks, mxfp4 and bf16 weights, the default process group and a high-priority one
# (HP=off: the default one only; BATCHES=n: forwards cycle through n batches of tokens);
# bench2: the same at 2 ranks (GPUs 0, 1); old / old2: the bench of an earlier tree unpacked in ./old (its own
# src and benchmarks, default options), for a same-machine comparison; nccl / nccl2: the NCCL tests
# (W = min(GPUs, 4) / 2); profile / profile2: profile_moe_ep.py at W / 2 ranks (bf16, both priorities;
# HP=off: the default group only). TAG=name: suffix of the bench's result folders and logs (runs of one call under
# different environments, e.g. TAG=ctas16 NCCL_MAX_CTAS=16). Results in one tarball $OUT/ep_results.tgz (the device runner returns a few
# files per call).
W=${1:-4}; shift; PARTS=${*:-"bench bench2 nccl"}
run() { echo "== $*"; timeout ${LIMIT:-240} "$@"; echo "rc=$?"; }
mkdir -p $OUT/ep && cd_out=$OUT/ep
nvidia-smi topo -m > $cd_out/topo.txt 2>&1
for part in $PARTS; do
  case $part in
    bench|bench2|old|old2)
      case $part in *2) n=2; export CUDA_VISIBLE_DEVICES=0,1 ;; *) n=$W ;; esac
      for fmt in ${FORMATS:-mxfp4 bf16}; do
        if [ "${part#old}" != "$part" ]; then
          (cd old && PYTHONPATH=src:. run torchrun --nproc-per-node $n --master-port 2963$n -m benchmarks.bench_moe_ep \
            --weight-format $fmt --out $cd_out/old_w${n}_$fmt > $cd_out/log_old_w${n}_$fmt.txt 2>&1)
        else
          run torchrun --nproc-per-node $n --master-port 2962$n -m benchmarks.bench_moe_ep --weight-format $fmt \
            --high-priority ${HP:-off on} --batches ${BATCHES:-1} --out $cd_out/w${n}_$fmt${TAG:+_$TAG} > $cd_out/log_w${n}_$fmt${TAG:+_$TAG}.txt 2>&1
        fi
      done
      unset CUDA_VISIBLE_DEVICES ;;
    nccl|nccl2)  # the NCCL tests at W = min(GPUs, 4), or at 2 (GPUs 0, 1)
      [ $part = nccl2 ] && export CUDA_VISIBLE_DEVICES=0,1
      run python -m pytest -q -p no:cacheprovider -rA tests/test_expert_parallel.py -k nccl > $cd_out/${part}_tests.txt 2>&1
      unset CUDA_VISIBLE_DEVICES
      grep -E "^(FAILED|ERROR)|passed|failed" $cd_out/${part}_tests.txt | tail -20 ;;
    profile|profile2)
      [ $part = profile2 ] && export CUDA_VISIBLE_DEVICES=0,1 && n=2 || n=$W
      for hp in ${HP:-off on}; do
        flag=; [ $hp = on ] && flag=--high-priority
        run torchrun --nproc-per-node $n --master-port 29640 lab/scripts/profile_moe_ep.py --weight-format bf16 $flag \
          > $cd_out/log_profile_w${n}_$hp.txt 2>&1
        mv $OUT/profile_*rank0.txt $cd_out/ 2>/dev/null; rm -f $OUT/profile_* $OUT/*.json
      done
      unset CUDA_VISIBLE_DEVICES ;;
  esac
done
for f in $cd_out/*w*/moe_ep.md; do echo "### $f"; grep -E "prefill|all_to_all|\| decode \| +\| +\| +\| 1 \|" $f; done
[ -n "$KEEP" ] && exit 0  # a later ep_session.sh call in the same command packs the results
cd $OUT && tar czf ep_results.tgz ep && rm -rf ep
