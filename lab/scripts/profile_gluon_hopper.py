"""One launch of the warp-specialized Gluon attention kernel for Nsight Compute (issue 23's profile evidence).

    ncu --set full -k regex:_attention_fwd_kernel -c 1 python -m benchmarks.profile_gluon_hopper \
        --batch 4 --seqlen 4096 --heads 16 --head-dim 128 [--causal] [--system cudnn]

``--system cudnn`` launches SDPA's cuDNN backend on the same problem instead, for the side-by-side profile.
"""
from __future__ import annotations

import argparse

import torch

from llmkernels.attention.gluon_hopper import gluon_attention


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--system", choices=("gluon", "cudnn"), default="gluon")
    args = parser.parse_args(argv)
    q, k, v = (torch.randn(args.batch, args.seqlen, args.heads, args.head_dim, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    for _ in range(2):
        if args.system == "gluon":
            gluon_attention(q, k, v, causal=args.causal)
        else:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)),
                                                                 is_causal=args.causal)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
