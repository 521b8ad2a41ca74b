"""CPU emulation of the kernel's P precision against float64 on the dequantized inputs.

fp32 products of the e4m3 values, online softmax per 128-key tile, P x 2^shift rounded to e4m3, l from the
unrounded (or rounded) P, bf16 output; and the same with O rounded to e4m3 (scale 448 / amax) as cuDNN's Hopper
FP8 SDPA writes it. Not the tensor core's own fp8 accumulation: an estimate of the error P's rounding causes.

    PYTHONPATH=lab/gluon_fp8_attention python lab/gluon_fp8_attention/emulate_p_rounding.py   # ~10 s
"""

from __future__ import annotations

import math

import run_gpu as r
import torch

r.DEVICE = "cpu"


def emulate(q8, k8, v8, qd, kd, vd, causal, shift_bits=8, tile=128, sum_quantized=False):
    batch, seqlen_q, heads, dim = q8.shape
    seqlen_kv = k8.shape[1]
    out = torch.zeros(batch, seqlen_q, heads, dim, dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            s = q8[b, :, h].float() @ k8[b, :, h].float().T  # raw scores
            c = float(qd[b, h]) * float(kd[b, h]) * dim**-0.5 * math.log2(math.e)
            if causal:
                i = torch.arange(seqlen_q)[:, None]
                j = torch.arange(seqlen_kv)[None, :]
                s = s.masked_fill(j > i + seqlen_kv - seqlen_q, float("-inf"))
            m = torch.full((seqlen_q,), float("-inf"))
            l_sum = torch.zeros(seqlen_q)
            acc = torch.zeros(seqlen_q, dim)
            for t0 in range(0, seqlen_kv, tile):
                st = s[:, t0 : t0 + tile]
                m_new = torch.maximum(m, st.max(1).values)
                m_scaled = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new * c)
                alpha = torch.exp2(m * c - m_scaled)
                p = torch.exp2(st * c - m_scaled[:, None] + shift_bits)
                p8 = p.to(torch.float8_e4m3fn).float()
                l_sum = l_sum * alpha + (p8 if sum_quantized else p).sum(1)
                acc = acc * alpha[:, None] + p8 @ v8[b, t0 : t0 + tile, h].float()
                m = m_new
            safe = torch.where(l_sum == 0, torch.ones_like(l_sum), l_sum)
            out[b, :, h] = (acc * float(vd[b, h]) / safe[:, None]).to(torch.bfloat16).double()
    return out


def main() -> None:
    for seqlen, v_mean, causal in ((1024, 0.0, False), (1024, 1.0, False), (2048, 0.0, True), (4096, 0.0, False)):
        q8, k8, v8, qd, kd, vd = r.make_inputs(1, seqlen, seqlen, 1, 1, 128, False, v_mean=v_mean)
        ref, pairs = r.reference(q8, k8, v8, qd, kd, vd, causal)
        results = []
        for shift, summed in ((0, False), (8, False), (8, True)):
            out = emulate(q8, k8, v8, qd, kd, vd, causal, shift, sum_quantized=summed)
            results.append(f"shift{shift}{'+sumq' if summed else ''} {r.errors(r.pick(out, pairs), ref)[0]:.3e}")
        out = emulate(q8, k8, v8, qd, kd, vd, causal, 8)
        scale_o = 448 / ref.abs().max().item()
        out8 = (out * scale_o).to(torch.float8_e4m3fn).double() / scale_o
        results.append(f"shift8, O e4m3 {r.errors(r.pick(out8, pairs), ref)[0]:.3e}")
        print(seqlen, v_mean, causal, results)


if __name__ == "__main__":
    main()
