"""Dense prefill over a grid (16k tokens, S 2k-16k, D 64/128/256, causal and not) against SDPA and FlexAttention.

    python -m benchmarks bench_attention_prefill [--out DIR] [--flex-dims 128] [--fp8] [--sinks]

B·S = 16k tokens with S in {2k, 4k, 8k, 16k}, Hq = Hkv = 16 and GQA 32/8, D in {64, 128, 256}, causal and not;
bf16; llmkernels against SDPA's cuDNN and flash backends (FlexAttention, compiled once per shape, at
the head dims of ``--flex-dims`` only: its compiles dominate the run). Each system is checked against
SDPA flash's output before it is timed, then timed eagerly (events) and as a CUDA-graph replay (not flex).
Writes ``attention_prefill_grid.{csv,md}`` and ``attention_prefill_grid.png`` (TFLOP/s against sequence
length, one panel per head dim and head layout, causal and not) to DIR (default
``benchmarks/results/<gpu>/bench_attention_prefill/``). GPU only.

``--fp8``: FP8 (e4m3) prefill at :data:`FP8_SHAPES` (B x H x S x D, Hq = Hkv), full and causal: ours on e4m3 q / k / v
with float32 descales ``[B, H]`` (its general per-(batch, KV head) path) against cuDNN's FP8 attention
(``sdpa_fp8`` of the cuDNN frontend's ``cudnn`` module, wheel nvidia-cudnn-frontend 1.32.0: skipped with a message
when it does not import), SDPA's cuDNN backend in bf16 on the dequantized values, and ours in bf16 on them. Each
system's relative error against a float64 reference on the dequantized inputs (two heads per shape). Writes
``attention_prefill_fp8.{csv,md,png}`` to DIR (default the suite's ``fp8/`` folder). GPU only.

``--sinks``: gpt-oss's attention (Hq 64, Hkv 8, D 64, bf16, a sink logit per q head; causal, and causal with its
128-token sliding window) at :data:`SINK_SHAPES`: ours with sinks, the same call on the portable kernel
(``FA4Config(warp_specialized=False)``), ours without sinks and SDPA's cuDNN backend without sinks (no peer here
takes sinks; the last two bound what the sinks cost). Writes ``attention_prefill_sinks.{csv,md,png}`` (default the
suite's ``sinks/`` folder).
"""

from __future__ import annotations

import argparse
import os

import torch

from benchmarks import bench_attention  # noqa: E402
from benchmarks.bench_attention import PEERS, bench, bench_graph, run_peer, run_peer_graph  # noqa: E402
from benchmarks.common import (  # noqa: E402
    bar_plot,
    default_out_dir,
    e4m3_descale,
    graph_time_ms,
    line_plots,
    measure_ceilings,
    require_gpu,
    write_table,
)
from benchmarks.peers import CUDNN_FRONTEND_WHEEL, cudnn_fp8_runner, sdpa_runner  # noqa: E402
from llmkernels.attention.api import attention  # noqa: E402
from llmkernels.testing import relative_error  # noqa: E402

TOKENS = 16 * 1024
SEQLENS = (2048, 4096, 8192, 16384)
HEAD_LAYOUTS = ((16, 16), (32, 8))  # (Hq, Hkv)
HEAD_DIMS = (64, 128, 256)

# --fp8: (batch, heads, seqlen, head_dim), Hq = Hkv, each full and causal (the FP8 issue's grid)
FP8_SHAPES = ((4, 16, 4096, 128), (2, 16, 8192, 128), (8, 16, 2048, 64), (4, 8, 4096, 256), (1, 32, 16384, 128))
FP8_SYSTEMS = ("ours_fp8", "cudnn_fp8", "sdpa_cudnn_bf16", "ours_bf16")
# --sinks: (batch, seqlen) of gpt-oss's attention (Hq 64, Hkv 8, D 64); masks: causal, and its 128-token window
SINK_SHAPES = ((1, 8192), (4, 4096), (16, 1024))
SINK_HEADS = (64, 8, 64)
SINK_SYSTEMS = ("ours_sinks", "portable_sinks", "ours_no_sinks", "sdpa_cudnn_no_sinks")
FP8_WRONG = 0.1  # a system whose relative error exceeds this is reported WRONG and not timed
REFERENCE_ROWS = 4096  # query rows per float64 score block of the reference (bounds its memory)


def problem_rows(seqlen: int, heads: int, kv_heads: int, head_dim: int, flex: bool, bf16_tflops: float) -> list:
    batch = TOKENS // seqlen
    q = torch.randn(batch, seqlen, heads, head_dim, dtype=torch.bfloat16, device="cuda")
    k, v = (torch.randn(batch, seqlen, kv_heads, head_dim, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    q_t, k_t, v_t = (x.transpose(1, 2) for x in (q, k, v))
    rows = []
    for causal in (False, True):
        flops = 4 * batch * heads * seqlen * seqlen * head_dim * (0.5 if causal else 1.0)
        expected = sdpa_runner("flash", q_t, k_t, v_t, causal=causal)().float()
        times = {}
        fn = lambda: attention(q, k, v, causal=causal)  # noqa: E731
        error = ((fn().float().transpose(1, 2) - expected).norm() / expected.norm()).item()
        times["llmkernels"] = (bench(fn), "") if error < 5e-2 else (None, f"WRONG (rel. error {error:.1e})")
        for peer in PEERS:
            if peer == "flex" and not flex:
                times[peer] = (None, "not run")
                continue
            times[peer] = run_peer(peer, q_t, k_t, v_t, causal, expected)
        # graph replay (no host launch time, which events count at 2k) of every system that ran, but flex
        graph = {"llmkernels": bench_graph(fn) if times["llmkernels"][0] else None}
        graph.update({name: run_peer_graph(name, q_t, k_t, v_t, causal) if times[name][0] else None for name in PEERS})
        ours_ms = times["llmkernels"][0]
        peer_ms = {name: times[name][0] for name in ("sdpa_cudnn", "sdpa_flash", "flex")}
        for system, (ms, note) in times.items():
            graph_ms = graph[system]
            tflops = flops / (graph_ms or ms) / 1e9 if ms else float("nan")
            rows.append(
                {
                    "seqlen": seqlen,
                    "batch": batch,
                    "heads": f"{heads}/{kv_heads}",
                    "head_dim": head_dim,
                    "causal": causal,
                    "system": system,
                    "ms": ms if ms else float("nan"),
                    "graph_ms": graph_ms if graph_ms else float("nan"),
                    "TFLOP/s": tflops,
                    "% bf16 peak": 100 * tflops / bf16_tflops,
                    **{
                        f"llmk vs {name}": peer / ours_ms if system == "llmkernels" and peer and ours_ms else ""
                        for name, peer in peer_ms.items()
                    },
                    **{
                        f"llmk vs {name} (graph)": graph[name] / graph["llmkernels"]
                        if system == "llmkernels" and graph[name] and graph["llmkernels"]
                        else ""
                        for name in ("sdpa_cudnn", "sdpa_flash")
                    },
                    "note": note,
                }
            )
    return rows


def fp8_inputs(batch: int, heads: int, seqlen: int, head_dim: int, device) -> dict:
    """Random bf16 q, k, v ``[B, S, H, D]`` quantized to e4m3, each with one per-tensor descale
    (:func:`~benchmarks.common.e4m3_descale`: a power of two, so the dequantized values are exact in bf16), held
    as a float32 ``[B, H]`` tensor of that one value: ours reads a descale per (batch, KV head), its general path,
    and cuDNN, whose FP8 SDPA takes scalars, gets the same value as its per-tensor descale. Returns the e4m3
    tensors ``q8``, ``k8``, ``v8``, their descales ``q_descale``, ``k_descale``, ``v_descale``, and the dequantized
    bf16 tensors ``q``, ``k``, ``v``: every system reads the same values."""
    inputs = {}
    for name in ("q", "k", "v"):
        x = torch.randn(batch, seqlen, heads, head_dim, dtype=torch.bfloat16, device=device)
        descale = e4m3_descale(x.float().abs().amax())
        x8 = (x.float() / descale).to(torch.float8_e4m3fn)
        inputs[f"{name}8"] = x8
        inputs[f"{name}_descale"] = descale.expand(batch, heads).contiguous()
        inputs[name] = (x8.float() * descale).to(torch.bfloat16)
        del x
    return inputs


def reference_heads(q, k, v, pairs, causal: bool) -> torch.Tensor:
    """float64 attention ``[len(pairs), S, D]`` of the (batch, head) ``pairs`` of ``[B, S, H, D]`` inputs (Hq =
    Hkv, Sq = Skv), softmax scale ``D^-0.5``, computed in blocks of :data:`REFERENCE_ROWS` query rows."""
    seqlen, head_dim = q.shape[1], q.shape[3]
    out = torch.empty(len(pairs), seqlen, head_dim, dtype=torch.float64, device=q.device)
    keys = torch.arange(seqlen, device=q.device)
    for n, (b, h) in enumerate(pairs):
        qh, kh, vh = (x[b, :, h].double() for x in (q, k, v))
        for start in range(0, seqlen, REFERENCE_ROWS):
            scores = qh[start : start + REFERENCE_ROWS] @ kh.T * head_dim**-0.5
            if causal:
                rows = torch.arange(start, start + scores.shape[0], device=q.device)
                scores.masked_fill_(keys[None, :] > rows[:, None], float("-inf"))
            out[n, start : start + scores.shape[0]] = torch.softmax(scores, dim=-1) @ vh
            del scores
    return out


def fp8_runners(inputs: dict, causal: bool) -> tuple[dict, dict]:
    """The systems of the FP8 mode on one problem: ``(runners, skipped)``. ``runners``: name -> ``(run, output)``,
    ``run()`` the timed call and ``output()`` its last result as ``[B, S, H, D]`` (cuDNN's e4m3 O divided by its
    ``scale_o``); ``skipped``: name -> why it did not run (cuDNN FP8 without its wheel, or without an engine)."""
    q8, k8, v8 = inputs["q8"], inputs["k8"], inputs["v8"]
    descales = dict(q_descale=inputs["q_descale"], k_descale=inputs["k_descale"], v_descale=inputs["v_descale"])
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    q_t, k_t, v_t = (x.transpose(1, 2) for x in (q, k, v))
    last = {}

    def keep(name, fn):
        def run():
            last[name] = fn()
            return last[name]

        return run

    runners = {
        "ours_fp8": keep("ours_fp8", lambda: attention(q8, k8, v8, causal=causal, **descales)),
        "sdpa_cudnn_bf16": keep("sdpa_cudnn_bf16", sdpa_runner("cudnn", q_t, k_t, v_t, causal=causal)),
        "ours_bf16": keep("ours_bf16", lambda: attention(q, k, v, causal=causal)),
    }
    outputs = {
        "ours_fp8": lambda: last["ours_fp8"],
        "sdpa_cudnn_bf16": lambda: last["sdpa_cudnn_bf16"].transpose(1, 2),
        "ours_bf16": lambda: last["ours_bf16"],
    }
    skipped = {}
    try:
        peer = cudnn_fp8_runner(q8, k8, v8, causal=causal, **descales)
        runners["cudnn_fp8"], outputs["cudnn_fp8"] = peer, peer.dequantized
    except ImportError:  # the whole message is printed once and stands in the table's header
        skipped["cudnn_fp8"] = f"skipped: no `cudnn` module ({CUDNN_FRONTEND_WHEEL} wheel)"
    except Exception as error:  # noqa: BLE001 - a peer without an engine for this problem is reported, not fatal
        skipped["cudnn_fp8"] = f"fails ({type(error).__name__}: {str(error)[:80]})"
    return {name: (runners[name], outputs[name]) for name in FP8_SYSTEMS if name in runners}, skipped


def fp8_problem_row(batch: int, heads: int, seqlen: int, head_dim: int, causal: bool, device="cuda") -> dict:
    """One row of the FP8 table (columns in :func:`fp8_notes`): every system checked against the float64
    reference on heads (0, 0) and (B - 1, H - 1), then timed as a CUDA-graph replay."""
    inputs = fp8_inputs(batch, heads, seqlen, head_dim, device)
    pairs = [(0, 0), (batch - 1, heads - 1)]
    expected = reference_heads(inputs["q"], inputs["k"], inputs["v"], pairs, causal)
    runners, skipped = fp8_runners(inputs, causal)
    errors, times, notes = {}, {}, dict(skipped)
    for name, (run, output) in runners.items():
        try:
            run()
            out = output()
            errors[name] = relative_error(torch.stack([out[b, :, h] for b, h in pairs]), expected)
            if not errors[name] <= FP8_WRONG:
                notes[name] = f"WRONG (rel. error {errors[name]:.2e})"
                continue
            times[name] = graph_time_ms(run)
        except Exception as error:  # noqa: BLE001 - a system that cannot run a problem is reported, not fatal
            notes[name] = f"fails ({type(error).__name__}: {str(error)[:80]})"
    flops = 4 * batch * heads * seqlen * seqlen * head_dim * (0.5 if causal else 1.0)
    ours = times.get("ours_fp8")
    row = {
        "shape": f"{batch}x{heads}x{seqlen}x{head_dim}",
        "causal": causal,
        **{f"{name} TFLOP/s": flops / times[name] / 1e9 if name in times else "-" for name in FP8_SYSTEMS},
        **{
            f"ours_fp8/{name}": times[name] / ours if ours and name in times else "-"
            for name in ("cudnn_fp8", "sdpa_cudnn_bf16", "ours_bf16")
        },
        **{f"err {name}": errors.get(name, "-") for name in FP8_SYSTEMS},
        **{f"{name} ms": times.get(name, "-") for name in FP8_SYSTEMS},
        "note": "; ".join(f"{name}: {note}" for name, note in notes.items()),
    }
    del inputs, runners, expected
    return row


def fp8_notes(gpu: str, cudnn_status: str) -> str:
    """The FP8 table's header text: what each column means and how the systems were given their inputs."""
    return (
        f"GPU: {gpu}, torch {torch.__version__}, triton {triton_version()}; cuDNN FP8: {cudnn_status}. B x H x S x D "
        "with Hq = Hkv = H, Sq = Skv = S, softmax scale D^-0.5; causal counts half the FLOPs (4 B H S^2 D, halved). "
        "Times are CUDA-graph replays (GPU time, no host launch cost).\n\n"
        "Inputs: bf16 randn q, k, v quantized to float8_e4m3fn with one descale per tensor, the power of two "
        "2^ceil(log2(amax / 448)). `ours_fp8` reads the e4m3 tensors with that descale given as a float32 [B, H] "
        "tensor (its general per-(batch, KV head) path; every entry the same value); `cudnn_fp8` (cuDNN's FP8 SDPA, "
        "`graph.sdpa_fp8`, which takes per-tensor scalar descales) reads the same e4m3 tensors with the same value "
        "as its scalar descales; `sdpa_cudnn_bf16` (torch SDPA, cuDNN backend) and `ours_bf16` read the "
        "dequantized values e4m3 x descale, exact in bf16. Every system computes attention on the same values.\n\n"
        "`X TFLOP/s`: X's rate. `ours_fp8/X`: X's time / ours_fp8's (> 1: ours FP8 faster). `err X`: "
        "||out - ref|| / ||ref|| (Frobenius; llmkernels.testing.relative_error) of X's output against a float64 "
        "reference on the dequantized inputs, over heads (0, 0) and (B-1, H-1). Ours write bf16 O; cuDNN's FP8 SDPA "
        "on Hopper writes e4m3 O (scaled by scale_o = 448 / amax(O), the amax from cuDNN's own amax output of a "
        "first call), so its error includes that e4m3 rounding of O. `-`: not run (see `note`)."
    )


def triton_version() -> str:
    import triton

    return triton.__version__


def cudnn_status() -> str:
    """One line on the cuDNN FP8 peer: the frontend's and cuDNN's versions, or why its column is skipped."""
    from benchmarks.peers import cudnn_frontend

    try:
        cudnn = cudnn_frontend()
    except ImportError as error:
        return f"column skipped ({error})"
    return f"frontend {getattr(cudnn, '__version__', '?')}, cuDNN {cudnn.backend_version()}"


def run_fp8(out_dir: str | None) -> None:
    """The ``--fp8`` mode: every shape of :data:`FP8_SHAPES`, full and causal; prints each row, then the table."""
    status = cudnn_status()
    print(f"cuDNN FP8 ({CUDNN_FRONTEND_WHEEL}): {status}", flush=True)
    rows = []
    for batch, heads, seqlen, head_dim in FP8_SHAPES:
        for causal in (False, True):
            rows.append(fp8_problem_row(batch, heads, seqlen, head_dim, causal))
            print({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in rows[-1].items()}, flush=True)
            torch.cuda.empty_cache()
    gpu = torch.cuda.get_device_name()
    out_dir = out_dir or default_out_dir("bench_attention_prefill/fp8")
    title = "FP8 prefill attention: ours against cuDNN's FP8 SDPA (and bf16 on the same values)"
    print(write_table(rows, out_dir, "attention_prefill_fp8", title, fp8_notes(gpu, status)))
    labels = [f"{row['shape']}{' causal' if row['causal'] else ''}" for row in rows]
    series = {
        name: [row[f"{name} TFLOP/s"] if row[f"{name} TFLOP/s"] != "-" else float("nan") for row in rows]
        for name in FP8_SYSTEMS
    }
    bar_plot(labels, series, "TFLOP/s (graph replay)", os.path.join(out_dir, "attention_prefill_fp8.png"), title)


def sinks_problem_row(batch: int, seqlen: int, window: bool, device="cuda") -> dict:
    """One row of the ``--sinks`` table: each system with sinks checked against the reference on q heads 0-7 (KV
    head 0) of the first sequence, then every system timed as a CUDA-graph replay."""
    from llmkernels.attention.config import default_config
    from llmkernels.attention.masks import SlidingWindow
    from llmkernels.attention.reference import attention_reference

    heads, kv_heads, head_dim = SINK_HEADS
    q = torch.randn(batch, seqlen, heads, head_dim, device=device, dtype=torch.bfloat16)
    k = torch.randn(batch, seqlen, kv_heads, head_dim, device=device, dtype=torch.bfloat16)
    v = torch.randn(batch, seqlen, kv_heads, head_dim, device=device, dtype=torch.bfloat16)
    sinks = torch.randn(heads, device=device) * 2
    mask = dict(causal=True, mask=SlidingWindow(127, 0)) if window else dict(causal=True)
    portable = default_config(head_dim, q.dtype, q.device).replace(warp_specialized=False)
    group = heads // kv_heads
    expected = attention_reference(q[:1, :, :group], k[:1, :, :1], v[:1, :, :1], sinks=sinks[:group], **mask)
    runners = {
        "ours_sinks": lambda: attention(q, k, v, sinks=sinks, **mask),
        "portable_sinks": lambda: attention(q, k, v, sinks=sinks, config=portable, **mask),
        "ours_no_sinks": lambda: attention(q, k, v, **mask),
    }
    if not window:
        q_t, k_t, v_t = (x.transpose(1, 2) for x in (q, k, v))
        runners["sdpa_cudnn_no_sinks"] = sdpa_runner("cudnn", q_t, k_t, v_t, causal=True)
    errors, times, notes = {}, {}, {}
    for name, run in runners.items():
        try:
            out = run()
            if name in SINK_SYSTEMS[:2]:  # the calls with sinks
                errors[name] = relative_error(out[:1, :, :group], expected)
                if not errors[name] <= 2e-2:
                    notes[name] = f"WRONG (rel. error {errors[name]:.2e})"
                    continue
            times[name] = graph_time_ms(run)
        except Exception as error:  # noqa: BLE001 - a system that cannot run a problem is reported, not fatal
            notes[name] = f"fails ({type(error).__name__}: {str(error)[:80]})"
    # (query, key) pairs the mask keeps: query i sees i + 1 keys, at most 128 with the window
    pairs = sum(min(i + 1, 128) for i in range(seqlen)) if window else seqlen * (seqlen + 1) // 2
    flops = 4 * batch * heads * head_dim * pairs
    ours = times.get("ours_sinks")
    row = {
        "shape": f"{batch}x{seqlen}",
        "mask": "causal, window 128" if window else "causal",
        **{f"{name} TFLOP/s": flops / times[name] / 1e9 if name in times else "-" for name in SINK_SYSTEMS},
        **{f"ours_sinks/{name}": times[name] / ours if ours and name in times else "-" for name in SINK_SYSTEMS[1:]},
        **{f"err {name}": errors.get(name, "-") for name in SINK_SYSTEMS[:2]},
        **{f"{name} ms": times.get(name, "-") for name in SINK_SYSTEMS},
        "note": "; ".join(f"{name}: {note}" for name, note in notes.items()),
    }
    return row


def run_sinks(out_dir: str | None) -> None:
    """The ``--sinks`` mode: every shape of :data:`SINK_SHAPES`, causal and windowed; prints each row, then the
    table."""
    rows = []
    for batch, seqlen in SINK_SHAPES:
        for window in (False, True):
            rows.append(sinks_problem_row(batch, seqlen, window))
            print({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in rows[-1].items()}, flush=True)
            torch.cuda.empty_cache()
    gpu = torch.cuda.get_device_name()
    out_dir = out_dir or default_out_dir("bench_attention_prefill/sinks")
    title = "gpt-oss attention (Hq 64, Hkv 8, D 64, sinks): ours against the portable kernel and sink-free bounds"
    notes = (
        f"GPU: {gpu}, torch {torch.__version__}, triton {triton_version()}. B x S, bf16 randn, sinks 2 x randn per "
        "q head; FLOPs count the (query, key) pairs each mask keeps (4 D per pair and head). Times are CUDA-graph "
        "replays. `ours_sinks`: llmkernels.attention with sinks (the Gluon prefill on Hopper); `portable_sinks`: "
        "the same call with FA4Config(warp_specialized=False); `ours_no_sinks`, `sdpa_cudnn_no_sinks` (causal "
        "only: SDPA has no window): the same attention without sinks. `ours_sinks/X`: X's time / ours_sinks' "
        "(> 1: ours faster). `err X`: relative error against the float32 reference on q heads 0-7 of sequence 0."
    )
    print(write_table(rows, out_dir, "attention_prefill_sinks", title, notes))
    labels = [f"{row['shape']} {row['mask']}" for row in rows]
    series = {
        name: [row[f"{name} TFLOP/s"] if row[f"{name} TFLOP/s"] != "-" else float("nan") for row in rows]
        for name in SINK_SYSTEMS
    }
    bar_plot(labels, series, "TFLOP/s (graph replay)", os.path.join(out_dir, "attention_prefill_sinks.png"), title)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--flex-dims", default="128", help="head dims at which FlexAttention runs ('' for none)")
    parser.add_argument(
        "--fp8", action="store_true", help="FP8 (e4m3) prefill against cuDNN's FP8 SDPA at the FP8 grid"
    )
    parser.add_argument("--sinks", action="store_true", help="gpt-oss's attention with sinks (Hq 64, Hkv 8, D 64)")
    args = parser.parse_args()
    require_gpu("bench_attention_prefill")
    torch.manual_seed(0)
    if args.fp8:
        run_fp8(args.out)
        return
    if args.sinks:
        run_sinks(args.out)
        return
    bench_attention.TIME_BUDGET_S = float("inf")  # that script's own time budget does not apply here
    ceilings = measure_ceilings()
    flex_dims = {int(d) for d in args.flex_dims.split(",") if d}
    rows = []
    for head_dim in HEAD_DIMS:
        for heads, kv_heads in HEAD_LAYOUTS:
            for seqlen in SEQLENS:
                rows += problem_rows(seqlen, heads, kv_heads, head_dim, head_dim in flex_dims, ceilings["bf16_tflops"])
                print(rows[-8:], flush=True)
    gpu = torch.cuda.get_device_name()
    out_dir = args.out or default_out_dir("bench_attention_prefill")
    header = (
        f"GPU: {gpu}, torch {torch.__version__}; bf16 matmul ceiling measured in this run "
        f"{ceilings['bf16_tflops']:.0f} TFLOP/s. B·S = {TOKENS} tokens; causal counts half the FLOPs. "
        "`llmk vs X`: X's time / ours (> 1: ours faster), median event times (do_bench); `(graph)`: the "
        "same from CUDA-graph replay times (no host launch time), which `TFLOP/s` also uses where there is one."
    )
    print(write_table(rows, out_dir, "attention_prefill_grid", "Prefill attention: the issue-8 grid", header))
    panels = {}
    for row in rows:
        if row["TFLOP/s"] == row["TFLOP/s"]:
            panel = f"D={row['head_dim']} H={row['heads']}{' causal' if row['causal'] else ''}"
            panels.setdefault(panel, {}).setdefault(row["system"], []).append((row["seqlen"], row["TFLOP/s"]))
    line_plots(
        panels,
        "sequence length",
        "TFLOP/s",
        os.path.join(out_dir, "attention_prefill_grid.png"),
        f"Prefill attention, bf16, {gpu}",
    )


if __name__ == "__main__":
    main()
