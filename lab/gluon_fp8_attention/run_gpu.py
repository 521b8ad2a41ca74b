"""GPU check of the FP8 attention prototype (fp8_attention.py) on an H100: correctness, then timings.

    python lab/gluon_fp8_attention/run_gpu.py            # writes $OUT/fp8_attention_gpu.csv when OUT is set
    python lab/gluon_fp8_attention/run_gpu.py --quick    # correctness only

1. Correctness against float64 attention on the dequantized inputs (``x8.double() * descale``): relative error
   ``||out - ref||_F / ||ref||_F`` and max abs error / max |ref|, over small shapes (ragged tails, GQA, per-head
   descales, causal with Sq != Skv), and on a few heads of the timed shapes. Next to it, on the same inputs
   (per-tensor descales, MHA), cuDNN's FP8 SDPA (cudnn frontend ``graph.sdpa_fp8``; on Hopper its O is e4m3,
   scaled by ``scale_o = 448 / amax(ref)``) when ``cudnn`` imports, and torch SDPA cuDNN bf16 on the dequantized
   values (rounded to bf16).
2. CUDA-graph-replay timings (TFLOP/s = 4 B H Sq Skv D / t, causal counts half) at 4x16x4096x128,
   2x16x8192x128 and 4x8x4096x256, full and causal: this kernel, torch SDPA (cuDNN backend) bf16 on the same values, cuDNN FP8.

Everything is in one process; the whole script aims at under 3 minutes on an H100.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import time
import traceback

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fp8_attention import fp8_attention  # noqa: E402

E4M3_MAX = 448.0
DEVICE = "cuda"


def quantize(x: torch.Tensor, num_kv_heads: int, per_head: bool):
    """bf16 ``[B, S, H, D]`` -> (e4m3, float32 descale ``[B, Hkv]``): amax per (batch, kv head group), or one
    per-tensor scale broadcast to ``[B, Hkv]``."""
    batch, _, heads, _ = x.shape
    group = heads // num_kv_heads
    if per_head:
        amax = x.float().abs().reshape(batch, x.shape[1], num_kv_heads, group, -1).amax(dim=(1, 3, 4))
    else:
        amax = x.float().abs().amax().expand(batch, num_kv_heads)
    descale = (amax.clamp_min(1e-12) / E4M3_MAX).float().contiguous()
    scale = descale.repeat_interleave(group, dim=1)[:, None, :, None]
    x8 = (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return x8, descale


def dequantize(x8: torch.Tensor, descale: torch.Tensor) -> torch.Tensor:
    group = x8.shape[2] // descale.shape[1]
    return x8.double() * descale.double().repeat_interleave(group, dim=1)[:, None, :, None]


def reference(q8, k8, v8, qd, kd, vd, causal, heads=None):
    """float64 ``[B, Sq, Hq', D]`` on the dequantized inputs; ``heads``: (batch, q head) pairs only, else all."""
    q, k, v = dequantize(q8, qd), dequantize(k8, kd), dequantize(v8, vd)
    batch, seqlen_q, num_q_heads, head_dim = q.shape
    seqlen_kv, group = k.shape[1], num_q_heads // k.shape[2]
    pairs = heads or [(b, h) for b in range(batch) for h in range(num_q_heads)]
    out = torch.zeros(len(pairs), seqlen_q, head_dim, dtype=torch.float64, device=q.device)
    mask = None
    if causal:
        i = torch.arange(seqlen_q, device=q.device)[:, None]
        mask = torch.arange(seqlen_kv, device=q.device)[None, :] <= i + seqlen_kv - seqlen_q
    for n, (b, h) in enumerate(pairs):
        s = (q[b, :, h] @ k[b, :, h // group].T) * head_dim**-0.5
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        out[n] = torch.nan_to_num(torch.softmax(s, dim=-1)) @ v[b, :, h // group]
    return out, pairs


def pick(out, pairs):
    return torch.stack([out[b, :, h].double() for b, h in pairs])


def errors(out, ref):
    diff = (out - ref).abs()
    rel = (diff.norm() / ref.norm().clamp_min(1e-30)).item()
    return rel, (diff.max() / ref.abs().max().clamp_min(1e-30)).item()


# ----------------------------------------------------------------------------------------------- peers
# cuDNN's FP8 SDPA (cudnn frontend ``graph.sdpa_fp8``, per-tensor descales, e4m3 O) lives in benchmarks/peers.py
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks.peers import cudnn_fp8_runner, cudnn_frontend  # noqa: E402

try:
    cudnn = cudnn_frontend()
    CUDNN_ERROR = None
except ImportError as error:
    cudnn, CUDNN_ERROR = None, str(error)


def sdpa_bf16(q, k, v, causal):
    """torch SDPA, cuDNN backend, bf16 ``[B, S, H, D]`` (views as ``[B, H, S, D]``)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
    return out.transpose(1, 2)


# ----------------------------------------------------------------------------------------------- timing
def graph_time(fn, calls: int = 5, replays: int = 4) -> float:
    """ms per call: ``calls`` calls captured in one CUDA graph, replayed ``replays`` times (median of replays)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return sorted(times)[len(times) // 2]


def make_inputs(batch, seqlen_q, seqlen_kv, num_q_heads, num_kv_heads, dim, per_head, seed=0, v_mean=0.0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    q = torch.randn(batch, seqlen_q, num_q_heads, dim, device=DEVICE, generator=gen, dtype=torch.bfloat16)
    k = torch.randn(batch, seqlen_kv, num_kv_heads, dim, device=DEVICE, generator=gen, dtype=torch.bfloat16)
    v = torch.randn(batch, seqlen_kv, num_kv_heads, dim, device=DEVICE, generator=gen, dtype=torch.bfloat16) + v_mean
    if per_head:  # heads of different magnitudes, so that a wrong descale index shows
        q = q * torch.linspace(0.5, 2.0, num_q_heads, device=DEVICE, dtype=torch.bfloat16)[None, None, :, None]
        k = k * torch.linspace(2.0, 0.5, num_kv_heads, device=DEVICE, dtype=torch.bfloat16)[None, None, :, None]
        v = v * torch.linspace(1.0, 3.0, num_kv_heads, device=DEVICE, dtype=torch.bfloat16)[None, None, :, None]
    q8, qd = quantize(q, num_kv_heads, per_head)
    k8, kd = quantize(k, num_kv_heads, per_head)
    v8, vd = quantize(v, num_kv_heads, per_head)
    return q8, k8, v8, qd, kd, vd


# fp8_attention keyword sets: the default first, then the alternatives kept for comparison
VARIANTS = {
    "default": {},
    "loop-carried P": dict(fused_pv=False),
    "loop-carried, P reshuffled": dict(fused_pv=False, permute_keys=False),
    "3 stages": dict(stages=3),
    "ping-pong (full only)": dict(pingpong=True),  # the consumers issue their wgmmas in turns (FA3)
    # FA4's softmax tricks (fp8_attention.py, NOTES.md "Conditional rescaling and exp2 on the FMA units"):
    # O rescaled only when a row's max grew by more than 4 (log2), P x 2^4; a share of the exp2s as a polynomial
    "cond rescale": dict(cond_rescale=True),
    "cond rescale + poly 1/8": dict(cond_rescale=True, poly_fraction=0.125),
    "cond rescale + poly 1/4": dict(cond_rescale=True, poly_fraction=0.25),
    "3 stages + cond rescale + poly 1/8": dict(stages=3, cond_rescale=True, poly_fraction=0.125),
}
OTHERS = list(VARIANTS)[1:]  # the columns after "ours" (the default) in both tables


def smoke() -> int:
    """One small call per variant (a child process, so that a hang is a timeout, not a stuck GPU job)."""
    for causal in (False, True):
        for variant in VARIANTS:
            q8, k8, v8, qd, kd, vd = make_inputs(1, 300, 300, 2, 1, 128, True)
            out = fp8_attention(q8, k8, v8, qd, kd, vd, causal=causal, **VARIANTS[variant])
            torch.cuda.synchronize()
            ref, pairs = reference(q8, k8, v8, qd, kd, vd, causal)
            print(f"smoke causal={causal} {variant}: rel {errors(pick(out, pairs), ref)[0]:.3e}", flush=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="correctness only")
    parser.add_argument("--smoke", action="store_true", help="(internal) the child's small calls")
    parser.add_argument(  # (each variant is two compiles, ~10-15 s each, in the child: the cache the rest reuses)
        "--smoke-timeout", type=float, default=60.0 + 40.0 * len(VARIANTS), help="seconds before a hang is declared"
    )
    args = parser.parse_args()
    if args.smoke:
        return smoke()
    t0 = time.time()
    import subprocess

    try:
        done = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--smoke"],
            capture_output=True,
            text=True,
            timeout=args.smoke_timeout,
        )
        print(done.stdout + done.stderr[-4000:])
        if done.returncode != 0:
            print("smoke run failed: stopping")
            return 2
    except subprocess.TimeoutExpired as expired:
        print(
            f"smoke run did not finish in {args.smoke_timeout:.0f} s (a hang: mbarrier phases?); output so far:\n"
            f"{(expired.stdout or b'').decode(errors='replace') if isinstance(expired.stdout, bytes) else expired.stdout}"
        )
        return 2
    print(f"(smoke {time.time() - t0:.0f} s)")
    print(
        f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
        f"{__import__('triton').__version__}, cudnn frontend: "
        f"{getattr(cudnn, '__version__', '?') if cudnn else 'not importable (' + CUDNN_ERROR + '): cuDNN FP8 skipped'}"
    )
    rows = []
    failed = False

    print(
        "\n## correctness vs float64 on the dequantized inputs (rel = ||out-ref||_F/||ref||_F; max = max|err|/max|ref|)"
    )
    print(
        f"| case | ours rel | ours max | other variants' rel ({' / '.join(OTHERS)}) "
        "| cuDNN FP8 rel | cuDNN FP8 max | SDPA bf16 rel |"
    )
    print("|" + " --- |" * 7)
    cases = [
        # B, Sq, Skv, Hq, Hkv, per_head, causal, v_mean, heads checked
        (1, 128, 128, 1, 1, False, False, 0.0, None),
        (2, 1000, 1000, 4, 4, False, False, 0.0, None),
        (2, 1000, 1000, 4, 4, False, True, 0.0, None),
        (1, 2048, 2048, 4, 4, False, False, 1.0, None),
        (2, 777, 1500, 8, 2, True, False, 0.0, None),
        (2, 300, 700, 8, 2, True, True, 0.0, None),
        (1, 700, 300, 4, 1, True, True, 0.0, None),  # Sq > Skv: the first 400 rows see no key (output 0)
        (1, 64, 5000, 2, 2, False, True, 0.0, None),
        (4, 4096, 4096, 16, 16, False, False, 0.0, [(0, 0), (3, 15)]),
        (4, 4096, 4096, 16, 16, False, True, 0.0, [(0, 0), (3, 15)]),
        (2, 8192, 8192, 16, 16, False, True, 0.0, [(1, 7)]),
    ]
    cases = [(*case, 128) for case in cases] + [
        (2, 1000, 1000, 4, 2, True, False, 0.0, None, 64),
        (2, 1000, 1500, 4, 4, False, True, 0.0, None, 64),
        (2, 2048, 2048, 4, 4, False, True, 0.0, None, 64),
        (2, 1000, 1000, 4, 2, True, False, 0.0, None, 256),
        (2, 1000, 1500, 4, 4, False, True, 0.0, None, 256),
        (1, 2048, 2048, 4, 4, False, False, 0.0, None, 256),
    ]
    for batch, sq, skv, hq, hkv, per_head, causal, v_mean, heads, dim in cases:
        label = (
            f"{batch}x{sq}x{skv} D{dim} Hq{hq}/Hkv{hkv} {'per-head' if per_head else 'per-tensor'} "
            f"{'causal' if causal else 'full'}{' v+1' if v_mean else ''}"
        )
        try:
            q8, k8, v8, qd, kd, vd = make_inputs(batch, sq, skv, hq, hkv, dim, per_head, v_mean=v_mean)
            ref, pairs = reference(q8, k8, v8, qd, kd, vd, causal, heads)
            out = fp8_attention(q8, k8, v8, qd, kd, vd, causal=causal)
            torch.cuda.synchronize()
            ours = errors(pick(out, pairs), ref)
            again = fp8_attention(q8, k8, v8, qd, kd, vd, causal=causal)
            repeat_equal = torch.equal(out.view(torch.int16), again.view(torch.int16))
            others = []
            for variant in OTHERS if dim == 128 else []:  # (each variant is a compile: D=128 only)
                other = fp8_attention(q8, k8, v8, qd, kd, vd, causal=causal, **VARIANTS[variant])
                torch.cuda.synchronize()
                others.append(errors(pick(other, pairs), ref)[0])
            finite = bool(torch.isfinite(out.float()).all())
            cud, sdpa = ("-", "-"), "-"
            if hq == hkv and (sq == skv or not causal):  # (torch's is_causal is top-left aligned: Sq == Skv only)
                deq = [dequantize(t, d).to(torch.bfloat16) for t, d in ((q8, qd), (k8, kd), (v8, vd))]
                try:  # (a peer's refusal, e.g. a head dim its cuDNN lacks, is not our failure)
                    sdpa = f"{errors(pick(sdpa_bf16(*deq, causal), pairs), ref)[0]:.3e}"
                except Exception as error:  # noqa: BLE001
                    sdpa = f"error: {type(error).__name__}: {str(error)[:120]}"
            if cudnn is not None and hq == hkv and not per_head and sq == skv:
                try:
                    peer = cudnn_fp8_runner(q8, k8, v8, qd, kd, vd, causal, ref.abs().max().item())
                    peer()
                    torch.cuda.synchronize()
                    cud = tuple(f"{e:.3e}" for e in errors(pick(peer.dequantized(), pairs), ref))
                except Exception as error:  # noqa: BLE001
                    cud = (f"error: {type(error).__name__}: {str(error)[:200]}", "-")
            bad = not finite or not repeat_equal or not all(e <= 0.06 for e in [ours[0], *others])  # NaN fails
            others = others or [float("nan")] * len(OTHERS)
            failed |= bad
            note = "" if not bad else f" **FAIL** (finite {finite}, repeat bit-equal {repeat_equal})"
            print(
                f"| {label} | {ours[0]:.3e} | {ours[1]:.3e} | {' / '.join(f'{e:.3e}' for e in others)} | "
                f"{cud[0]} | {cud[1]} | {sdpa} |{note}",
                flush=True,
            )
            rows.append(
                dict(
                    kind="error",
                    case=label,
                    ours_rel=ours[0],
                    ours_max=ours[1],
                    **{f"rel {name}": e for name, e in zip(OTHERS, others)},
                    cudnn_fp8_rel=cud[0],
                    cudnn_fp8_max=cud[1],
                    sdpa_bf16_rel=sdpa,
                    repeat_equal=repeat_equal,
                )
            )
            del q8, k8, v8, ref, out, again
        except Exception as error:  # noqa: BLE001
            failed = True
            print(f"| {label} | ERROR {type(error).__name__}: {str(error)[:400]} |", flush=True)
            traceback.print_exc()
    print(f"(correctness {time.time() - t0:.0f} s)")

    if not args.quick:
        print("\n## CUDA-graph replay timings (TFLOP/s; causal counts half the products)")
        header = (
            f"| shape | causal | ours ms | ours TFLOP/s | {' | '.join(OTHERS)} "
            "| SDPA cuDNN bf16 TFLOP/s | cuDNN FP8 TFLOP/s | ours / cuDNN FP8 | ours / bf16 |"
        )
        print(header)
        print("|" + " --- |" * (header.count("|") - 1))
        for batch, seq, heads, dim in ((4, 4096, 16, 128), (2, 8192, 16, 128), (4, 4096, 8, 256)):
            for causal in (False, True):
                try:
                    q8, k8, v8, qd, kd, vd = make_inputs(batch, seq, seq, heads, heads, dim, False)
                    flops = 4 * batch * heads * seq * seq * dim / (2 if causal else 1)
                    ours_ms = graph_time(lambda: fp8_attention(q8, k8, v8, qd, kd, vd, causal=causal))
                    # (D 256: the variants never ran in the smoke child, so only the one that cannot deadlock)
                    timed = OTHERS if dim == 128 else ["3 stages"]
                    others = [
                        graph_time(lambda: fp8_attention(q8, k8, v8, qd, kd, vd, causal=causal, **VARIANTS[name]))
                        if name in timed
                        else float("nan")
                        for name in OTHERS
                    ]
                    deq = [dequantize(t, d).to(torch.bfloat16) for t, d in ((q8, qd), (k8, kd), (v8, vd))]
                    bf16_ms = graph_time(lambda: sdpa_bf16(*deq, causal))
                    fp8_ms = float("nan")
                    if cudnn is not None:
                        try:
                            peer = cudnn_fp8_runner(q8, k8, v8, qd, kd, vd, causal, 1.0)
                            fp8_ms = graph_time(peer)
                        except Exception as error:  # noqa: BLE001
                            print(f"(cuDNN FP8 timing failed: {type(error).__name__}: {str(error)[:300]})")
                    tf = lambda ms: flops / (ms * 1e-3) / 1e12  # noqa: E731
                    print(
                        f"| {batch}x{heads}x{seq}x{dim} | {causal} | {ours_ms:.3f} | {tf(ours_ms):.0f} | "
                        f"{' | '.join(f'{tf(ms):.0f}' for ms in others)} | {tf(bf16_ms):.0f} | {tf(fp8_ms):.0f} | {fp8_ms / ours_ms:.2f} | {bf16_ms / ours_ms:.2f} |",
                        flush=True,
                    )
                    rows.append(
                        dict(
                            kind="time",
                            case=f"{batch}x{heads}x{seq}x{dim} causal={causal}",
                            ours_ms=ours_ms,
                            ours_tflops=tf(ours_ms),
                            **{f"tflops {name}": tf(ms) for name, ms in zip(OTHERS, others)},
                            sdpa_bf16_tflops=tf(bf16_ms),
                            cudnn_fp8_tflops=tf(fp8_ms),
                        )
                    )
                    del q8, k8, v8, deq
                except Exception as error:  # noqa: BLE001
                    failed = True
                    print(
                        f"| {batch}x{heads}x{seq}x{dim} | {causal} | ERROR {type(error).__name__}: {str(error)[:400]} |"
                    )
                    traceback.print_exc()
    out_dir = os.environ.get("OUT")
    if out_dir:
        keys = sorted({key for row in rows for key in row})
        path = os.path.join(out_dir, "fp8_attention_gpu.csv")
        with open(path, "w", newline="") as file:
            writer = csv.DictWriter(file, fieldnames=keys)
            writer.writeheader()
            writer.writerows(rows)
        print(f"wrote {path}")
    print(f"total {time.time() - t0:.0f} s; {'FAILED' if failed else 'ok'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
