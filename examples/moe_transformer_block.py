"""A small MoE transformer block (attention + MoE feed-forward) built on llmkernels, run through
torch.compile(fullgraph=True), printing tokens/s.

    python examples/moe_transformer_block.py            # on the GPU (a Qwen3-30B-A3B-sized layer)
    python examples/moe_transformer_block.py --tiny     # tiny sizes; without a GPU, through the interpreter
"""

from __future__ import annotations

import argparse
import os
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before llmkernels defines its kernels

from torch import nn  # noqa: E402

import llmkernels as lk  # noqa: E402
from llmkernels.moe import MoEFeedForward  # noqa: E402


class MoETransformerBlock(nn.Module):
    """Pre-norm block: x + attention(norm(x)), then x + moe(norm(x)); GQA causal attention."""

    def __init__(
        self,
        hidden: int,
        heads: int,
        kv_heads: int,
        experts: int,
        intermediate: int,
        top_k: int,
        weight_format: str,
        device,
        dtype=torch.bfloat16,
    ):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.attn_norm = nn.RMSNorm(hidden, device=device, dtype=dtype)
        self.qkv = nn.Linear(hidden, (heads + 2 * kv_heads) * self.head_dim, bias=False, device=device, dtype=dtype)
        self.proj = nn.Linear(heads * self.head_dim, hidden, bias=False, device=device, dtype=dtype)
        self.moe_norm = nn.RMSNorm(hidden, device=device, dtype=dtype)
        router = torch.randn(experts, hidden, device=device) * hidden**-0.5
        w_gate_up = torch.randn(experts, 2 * intermediate, hidden, device=device) * hidden**-0.5
        w_down = torch.randn(experts, hidden, intermediate, device=device) * intermediate**-0.5
        self.moe = MoEFeedForward.from_float(router, w_gate_up, w_down, top_k, weight_format=weight_format)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, S, H]
        batch, seqlen, _ = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).split(
            [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim], dim=-1
        )
        attn = lk.attention(
            q.reshape(batch, seqlen, self.heads, self.head_dim),
            k.reshape(batch, seqlen, self.kv_heads, self.head_dim),
            v.reshape(batch, seqlen, self.kv_heads, self.head_dim),
            causal=True,
        )
        x = x + self.proj(attn.reshape(batch, seqlen, -1))
        return x + self.moe(self.moe_norm(x))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny sizes (the default without a GPU)")
    parser.add_argument("--weight-format", default="mxfp8")
    args = parser.parse_args()
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda" if on_gpu else "cpu")
    tiny = args.tiny or not on_gpu
    if tiny:
        sizes = dict(hidden=128, heads=4, kv_heads=2, experts=8, intermediate=64, top_k=2)
        batch, seqlen = 2, 16
    else:  # one Qwen3-30B-A3B layer
        sizes = dict(hidden=2048, heads=32, kv_heads=4, experts=128, intermediate=768, top_k=8)
        batch, seqlen = 8, 1024
    torch.manual_seed(0)
    block = MoETransformerBlock(**sizes, weight_format=args.weight_format, device=device)
    x = torch.randn(batch, seqlen, sizes["hidden"], device=device, dtype=torch.bfloat16)
    compiled = torch.compile(block, fullgraph=True, backend="inductor" if on_gpu else "aot_eager")
    with torch.no_grad():
        eager = block(x)
        out = compiled(x)  # compiles
        error = ((out.float() - eager.float()).norm() / eager.float().norm()).item()
        runs = 20 if on_gpu else 1
        if on_gpu:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(runs):
            out = compiled(x)
        if on_gpu:
            torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / runs
    where = torch.cuda.get_device_name() if on_gpu else "CPU, Triton interpreter"
    print(f"MoE transformer block {sizes}, {batch}x{seqlen} tokens, {args.weight_format} experts, on {where}")
    print(f"compiled vs eager: relative difference {error:.1e}; {batch * seqlen / seconds:,.0f} tokens/s")


if __name__ == "__main__":
    main()
