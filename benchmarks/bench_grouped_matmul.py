"""Grouped MoE matmul, every weight format over a tokens-per-expert sweep, against torch._grouped_mm and peers.

    PYTHONPATH=src:.peers/triton_kernels python -m benchmarks bench_grouped_matmul [--out DIR] [--quick | --targets]

llmkernels.grouped_matmul next to torch._grouped_mm (bf16), torch._scaled_grouped_mm (fp8 rowwise) and OpenAI's
triton_kernels.matmul_ogs (bf16 x MXFP4 in its Hopper layouts, and bf16; skipped with a message when
``triton_kernels`` is not importable), same shapes, one run, every system timed as a CUDA-graph replay (GPU time,
no host overhead).

``--targets``: only issue 21's grid (E=128 x {1, 16, 64, 256} at N=4096, K=7168; E=32 x {4, 64, 512} at
N=5760, K=2880; E=8 x 2048; DeepSeek-V3 down at 16 and 256).
``--fp8``: only the FP8-block systems (fp8 (1, 128) x fp8 (128, 128) and bf16 x fp8 (128, 128)) with bf16 and
MXFP8 for reference, at the FP8 grid (:data:`FP8_TARGETS`), next to cuBLAS's dense block-scaled GEMM
(``F.scaled_mm`` BlockWise1x128 x BlockWise128x128 on all tokens against one expert: the same FLOPs, no grouping).

Sweeps tokens per expert (1 .. 4096) over the MoE projections of DeepSeek-V3, Qwen3-30B-A3B,
gpt-oss-120b and Mixtral, plus Zipf-routed (imbalanced) and half-empty groupings, and times the
activation quantize kernel. Prints tables (µs, TFLOP/s, GB/s, % of the measured ceilings, ratio to
each peer) and writes grouped_matmul.{csv,md}, quantize.{csv,md}, routing.{csv,md} and one PNG per
regime (decode: weight GB/s, compute: TFLOP/s, against tokens per expert) to DIR (default
benchmarks/results/<gpu>/bench_grouped_matmul/, with ``--fp8`` its ``fp8/`` folder).
"""

from __future__ import annotations

import argparse
import os

import torch

import llmkernels as lk  # noqa: E402
from benchmarks.common import (  # noqa: E402
    default_out_dir,
    graph_time_ms,
    line_plots,
    measure_ceilings,
    require_gpu,
    time_ms,
    write_table,
    zipf_offsets,
)
from benchmarks.peers import TritonKernelsExperts  # noqa: E402
from llmkernels.grouped_matmul import HOPPER_COPIES  # noqa: E402
from llmkernels.testing import relative_error  # noqa: E402

# name: (experts, N, K) of one grouped projection (gate_up: N = 2 x intermediate).
MODELS = {
    "DeepSeek-V3 gate_up": (256, 4096, 7168),
    "DeepSeek-V3 down": (256, 7168, 2048),
    "Qwen3-30B-A3B gate_up": (128, 1536, 2048),
    "Qwen3-30B-A3B down": (128, 2048, 768),
    "gpt-oss-120b gate_up": (128, 5760, 2880),
    "Mixtral gate_up": (8, 28672, 4096),
}
# issue 21's grid: name -> (experts, N, K, tokens per expert)
TARGETS = {
    "E128 4096x7168": (128, 4096, 7168, (1, 16, 64, 256)),
    "E32 5760x2880": (32, 5760, 2880, (4, 64, 512)),
    "E8 4096x7168": (8, 4096, 7168, (2048,)),
    "DeepSeek-V3 down": (256, 7168, 2048, (16, 256)),
}
# the FP8-block grid: DeepSeek-V3's projections (E=16 where 256 experts would not fit the token counts), decode and
# the compute-bound E=8 point
FP8_TARGETS = {
    "E8 4096x7168": (8, 4096, 7168, (2048,)),
    "DeepSeek-V3 gate_up E16": (16, 4096, 7168, (256, 1024, 4096)),
    "DeepSeek-V3 down E16": (16, 7168, 2048, (256, 1024, 4096)),
    "DeepSeek-V3 down": (256, 7168, 2048, (256,)),
    "E128 4096x7168": (128, 4096, 7168, (1, 16)),
}
TOKENS_PER_EXPERT = (1, 4, 16, 64, 512, 1024, 4096)
MAX_ROWS = 131072  # larger points are skipped (E=256 stops at 512 tokens per expert)
DECODE_MAX, COMPUTE_MIN = 64, 512  # the regimes, in tokens per expert
# label: (activation format, weight format); peers are timed by their own functions. "<format> hopper": weights
# converted ahead with to_layout("hopper"); "<format>": quantize's row layout as the README writes it (on a Hopper
# GPU grouped_matmul reads it through its Hopper-layout copy); "<format> row-kernel": the row layout with that copy
# turned off (HOPPER_COPIES.enabled = False), the kernel other GPUs run.
OURS = {
    "ours bf16": ("bf16", "bf16"),
    "ours mxfp8": ("mxfp8", "mxfp8"),
    "ours bf16 x mxfp8": ("bf16", "mxfp8"),
    "ours mxfp4": ("mxfp4", "mxfp4"),
    "ours bf16 x mxfp4": ("bf16", "mxfp4"),
    "ours bf16 x mxfp4 row kernel": ("bf16", "mxfp4 row-kernel"),
    "ours bf16 x mxfp4 hopper": ("bf16", "mxfp4 hopper"),
    "ours mxfp4 x mxfp4 hopper": ("mxfp4", "mxfp4 hopper"),
    "ours nvfp4": ("nvfp4", "nvfp4"),
    "ours bf16 x nvfp4 hopper": ("bf16", "nvfp4 hopper"),
    "ours nvfp4 x nvfp4 hopper": ("nvfp4", "nvfp4 hopper"),
    "ours fp8 blocks": ("fp8", "fp8"),
    "ours bf16 x fp8 blocks": ("bf16", "fp8"),
    "ours w4a8 (fp8 x mxfp4)": ("fp8", "mxfp4"),
}
FP8_SYSTEMS = ("ours bf16", "ours mxfp8", "ours fp8 blocks", "ours bf16 x fp8 blocks", "ours w4a8 (fp8 x mxfp4)")
# fp8 blocks: activations per token per 128 columns, weights per 128 x 128 tile
FP8_BLOCKS = {"activations": (1, 128), "weights": (128, 128)}
PEER_BF16, PEER_FP8 = "torch._grouped_mm bf16", "torch._scaled_grouped_mm fp8"
PEER_TK_MXFP4, PEER_TK_BF16 = "triton_kernels bf16 x mxfp4", "triton_kernels bf16"
PEER_DENSE_BLOCKWISE = "cuBLAS dense fp8 blockwise"
BYTES_PER_ELEMENT = {"bf16": 2.0, "fp8": 1.0, "mxfp8": 1 + 1 / 32, "mxfp4": 0.5 + 1 / 32, "nvfp4": 0.5 + 1 / 16}


def _balanced_offsets(num_experts: int, tokens_per_expert: int) -> torch.Tensor:
    return torch.arange(num_experts + 1, dtype=torch.int32, device="cuda") * tokens_per_expert


class Problem:
    """One projection's weights in every format, made once, and activations for up to max_rows."""

    def __init__(self, num_experts: int, n: int, k: int, max_rows: int, formats: set[str]):
        self.num_experts, self.n, self.k = num_experts, n, k
        self.w = torch.randn(num_experts, n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
        self.x = torch.randn(max_rows, k, device="cuda", dtype=torch.bfloat16)
        # "<format> hopper": the weights in the Hopper layout (ScaledTensor.to_layout("hopper"))
        self.weights = {
            fmt: self.w if fmt == "bf16" else _quantize(self.w, fmt.split()[0], "weights") for fmt in formats
        }
        for fmt in formats:
            if fmt.endswith(" hopper"):
                self.weights[fmt] = self.weights[fmt].to_layout("hopper")
        self.w_fp8_t = self.w.to(torch.float8_e4m3fn).transpose(-2, -1)
        self.ids = torch.arange(num_experts, dtype=torch.int32, device="cuda")
        try:
            self.triton_kernels = TritonKernelsExperts(self.w)
        except ImportError as error:
            self.triton_kernels = None
            print(f"  triton_kernels peer skipped: {error} (put its package on PYTHONPATH)")

    def ours(self, activation_format: str, weight_format: str, offsets: torch.Tensor):
        rows = int(offsets[-1])
        x = self.x[:rows]
        a = x if activation_format == "bf16" else _quantize(x, activation_format, "activations")
        b, ids = self.weights[weight_format], self.ids[: offsets.numel() - 1]
        if weight_format.endswith(" row-kernel"):
            return lambda: _without_hopper_copies(lambda: lk.grouped_matmul(a, b, offsets, ids))
        return lambda: lk.grouped_matmul(a, b, offsets, ids)

    def peer_bf16(self, offsets: torch.Tensor):
        x, w_t = self.x[: int(offsets[-1])], self.w.transpose(-2, -1)
        return lambda: torch._grouped_mm(x, w_t, offs=offsets[1:], out_dtype=torch.bfloat16)

    def peer_fp8(self, offsets: torch.Tensor):
        x = self.x[: int(offsets[-1])].to(torch.float8_e4m3fn)
        scale_a = torch.ones(x.shape[0], device="cuda")
        scale_b = torch.ones(self.num_experts, self.n, device="cuda")
        return lambda: torch._scaled_grouped_mm(
            x, self.w_fp8_t, scale_a, scale_b, offs=offsets[1:], out_dtype=torch.bfloat16
        )

    def peer_dense_blockwise(self, offsets: torch.Tensor):
        """cuBLAS's block-scaled fp8 GEMM of all the tokens against expert 0 (the grouped call's FLOPs): scale_a
        token-major (``[K/128, T]`` seen transposed), scale_b ``[N/128, K/128]`` seen transposed, as it takes them."""
        from torch.nn.functional import ScalingType, scaled_mm

        a = _quantize(self.x[: int(offsets[-1])], "fp8", "activations")
        w = self.weights["fp8"] if "fp8" in self.weights else _quantize(self.w, "fp8", "weights")
        scale_a = a.scales.t().contiguous().t()
        b, scale_b = w.data[0], w.scales[0]
        return lambda: scaled_mm(
            a.data,
            b.t(),
            scale_a,
            ScalingType.BlockWise1x128,
            scale_b.t(),
            ScalingType.BlockWise128x128,
            output_dtype=torch.bfloat16,
        )


def _without_hopper_copies(call):
    HOPPER_COPIES.enabled = False
    try:
        return call()
    finally:
        HOPPER_COPIES.enabled = True


def _quantize(x: torch.Tensor, fmt: str, role: str):
    """``x`` in ``fmt``; fp8 blocks per token and 128 columns (activations) or per 128 x 128 tile (weights)."""
    return lk.quantize(x, fmt, block=FP8_BLOCKS[role]) if fmt == "fp8" else lk.quantize(x, fmt)


def _time(make) -> tuple[float, object]:
    """(ms of a CUDA-graph replay, output) of a peer or of ours; (nan, None) when it fails, reported and not
    fatal."""
    try:
        fn = make()
        out = fn()
        return graph_time_ms(fn), out
    except Exception as error:  # noqa: BLE001 - a failing system is a result too
        print(f"  fails: {type(error).__name__}: {str(error)[:160]}")
        return float("nan"), None


def sweep(
    problem: Problem, model: str, tokens_per_expert: int, ceilings: dict, offsets=None, label=None, ours=OURS
) -> list:
    """Rows for every system of ``ours`` and the peers on one grouping (balanced unless offsets are given); with
    fp8-block systems, cuBLAS's dense block-scaled GEMM too."""
    offsets = _balanced_offsets(problem.num_experts, tokens_per_expert) if offsets is None else offsets
    rows_total = int(offsets[-1])
    flops = 2.0 * rows_total * problem.n * problem.k
    weight_elements = problem.num_experts * problem.n * problem.k
    x = problem.x[:rows_total]
    systems = {
        PEER_BF16: (("bf16", "bf16"), lambda: problem.peer_bf16(offsets)),
        PEER_FP8: (("fp8", "fp8"), lambda: problem.peer_fp8(offsets)),
    }
    if problem.triton_kernels is not None:
        systems[PEER_TK_MXFP4] = (("bf16", "mxfp4"), lambda: problem.triton_kernels.mxfp4(x, offsets))
        systems[PEER_TK_BF16] = (("bf16", "bf16"), lambda: problem.triton_kernels.bf16(x, offsets))
    if any(fb == "fp8" for _, fb in ours.values()):
        systems[PEER_DENSE_BLOCKWISE] = (("fp8", "fp8"), lambda: problem.peer_dense_blockwise(offsets))
    for name, (fa, fb) in ours.items():
        systems[name] = ((fa, fb), lambda fa=fa, fb=fb: problem.ours(fa, fb, offsets))
    timings, reference = {}, None
    for name, (formats, make) in systems.items():
        ms, out = _time(make)
        error = float("nan")
        if out is not None:
            if name == PEER_BF16:
                reference = out.float()
            elif reference is not None and name != PEER_DENSE_BLOCKWISE:  # one expert's product: nothing to compare
                error = relative_error(out.float(), reference)
                if not error < 0.3:  # quantized formats differ from bf16 by their rounding, not more
                    print(f"  {name}: rel. error {error:.2e} against {PEER_BF16}: not timed")
                    ms = float("nan")
        timings[name] = (ms, formats, error)
    rows = []
    for name, (ms, (fa, fb), error) in timings.items():
        weight_bytes = weight_elements * BYTES_PER_ELEMENT[fb.split()[0]]
        total_bytes = weight_bytes + rows_total * (problem.k * BYTES_PER_ELEMENT[fa] + problem.n * 2)
        rows.append(
            {
                "model": model,
                "routing": label or "balanced",
                "tokens/expert": tokens_per_expert,
                "system": name,
                "us": ms * 1e3,
                "TFLOP/s": flops / ms / 1e9,
                "GB/s": total_bytes / ms / 1e6,
                "weight GB/s": weight_bytes / ms / 1e6,
                "% bf16 peak": 100 * flops / ms / 1e9 / ceilings["bf16_tflops"],
                "% copy BW": 100 * total_bytes / ms / 1e6 / ceilings["copy_gbps"],
                "vs _grouped_mm": timings[PEER_BF16][0] / ms,
                "vs _scaled_grouped_mm": timings[PEER_FP8][0] / ms,
                "vs_triton_kernels": timings.get(PEER_TK_MXFP4, (float("nan"),))[0] / ms,
                "vs dense blockwise": timings.get(PEER_DENSE_BLOCKWISE, (float("nan"),))[0] / ms,
                "rel err vs bf16": error,
            }
        )
    return rows


def quantize_rows(ceilings: dict) -> list:
    """Activation quantize kernel: bytes read + written against the copy bandwidth."""
    rows = []
    for tokens, k in ((16384, 7168), (4096, 2880), (65536, 2048)):
        x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
        for fmt in ("mxfp8", "mxfp4", "nvfp4", "fp8"):
            global_scale = lk.quantize(x, fmt).global_scale if fmt == "nvfp4" else None
            if fmt == "fp8":  # fp8 blocks (1, 128), the activations' block
                ms = time_ms(lambda: _quantize(x, fmt, "activations"))
            else:
                ms = time_ms(lambda: lk.quantize(x, fmt, global_scale=global_scale))
            moved = tokens * k * (2 + BYTES_PER_ELEMENT[fmt])
            rows.append(
                {
                    "tokens": tokens,
                    "K": k,
                    "format": fmt,
                    "us": ms * 1e3,
                    "GB/s": moved / ms / 1e6,
                    "% copy BW": 100 * moved / ms / 1e6 / ceilings["copy_gbps"],
                }
            )
            if fmt == "nvfp4":  # and with the per-tensor amax pass that a fresh global scale needs
                ms = time_ms(lambda: lk.quantize(x, fmt))
                rows.append(
                    {
                        "tokens": tokens,
                        "K": k,
                        "format": "nvfp4 + amax",
                        "us": ms * 1e3,
                        "GB/s": moved / ms / 1e6,
                        "% copy BW": 100 * moved / ms / 1e6 / ceilings["copy_gbps"],
                    }
                )
        del x
    return rows


def routing_rows(problem: Problem, model: str, ceilings: dict) -> list:
    """Zipf-routed and half-empty groupings next to balanced ones with the same token count."""
    rows = []
    for tokens_per_expert in (16, 512):
        total = problem.num_experts * tokens_per_expert
        if total > problem.x.shape[0]:
            continue
        rows += sweep(problem, model, tokens_per_expert, ceilings)
        rows += sweep(problem, model, tokens_per_expert, ceilings, zipf_offsets(problem.num_experts, total), "zipf 1.2")
        # every other group empty: the same tokens in half the groups, ids of all experts listed
        sizes = torch.zeros(problem.num_experts, dtype=torch.int32)
        sizes[::2] = 2 * tokens_per_expert
        offsets = torch.cat([torch.zeros(1, dtype=torch.int32), sizes.cumsum(0).int()]).cuda()
        rows += sweep(problem, model, tokens_per_expert, ceilings, offsets, "half empty")
    return [
        r
        for r in rows
        if r["system"]
        in (
            PEER_BF16,
            "ours bf16",
            "ours mxfp8",
            "ours bf16 x mxfp4",
            "ours bf16 x mxfp4 row kernel",
            "ours bf16 x mxfp4 hopper",
        )
    ]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--quick", action="store_true", help="two projections, four token counts")
    parser.add_argument("--targets", action="store_true", help="issue 21's grid only")
    parser.add_argument("--fp8", action="store_true", help="the fp8-block systems at the FP8 grid only")
    args = parser.parse_args()
    require_gpu("bench_grouped_matmul")
    out_dir = args.out or default_out_dir("bench_grouped_matmul" + ("/fp8" if args.fp8 else ""))
    torch.manual_seed(0)
    ceilings = measure_ceilings()
    gpu = torch.cuda.get_device_name()
    print(
        f"{gpu}: copy {ceilings['copy_gbps']:.0f} GB/s, bf16 {ceilings['bf16_tflops']:.0f} TFLOP/s, "
        f"fp8 {ceilings['fp8_tflops']:.0f} TFLOP/s",
        flush=True,
    )
    models = {name: (*shape, TOKENS_PER_EXPERT) for name, shape in MODELS.items()}
    if args.quick:
        models = {name: (*shape[:3], (1, 16, 64, 512)) for name, shape in list(models.items())[2:4]}
    models = TARGETS if args.targets else models if args.quick else {**TARGETS, **models}
    ours = OURS
    if args.fp8:
        models, ours = FP8_TARGETS, {name: OURS[name] for name in FP8_SYSTEMS}
    weight_formats = {fb for _, fb in ours.values()}
    rows, routing = [], []
    for model, (num_experts, n, k, token_counts) in models.items():
        counts = [t for t in token_counts if num_experts * t <= MAX_ROWS]
        problem = Problem(num_experts, n, k, num_experts * max(counts), weight_formats)
        for tokens_per_expert in counts:
            print(f"{model}: {tokens_per_expert} tokens per expert", flush=True)
            rows += sweep(problem, model, tokens_per_expert, ceilings, ours=ours)
        if not args.fp8 and model in ("DeepSeek-V3 gate_up", "Qwen3-30B-A3B gate_up"):
            routing += routing_rows(problem, model, ceilings)
        del problem
        torch.cuda.empty_cache()

    header = (
        f"GPU: {gpu}, torch {torch.__version__}. Ceilings measured in this run: copy "
        f"{ceilings['copy_gbps']:.0f} GB/s, bf16 matmul {ceilings['bf16_tflops']:.0f} TFLOP/s, fp8 matmul "
        f"{ceilings['fp8_tflops']:.0f} TFLOP/s. Times are medians of CUDA-graph replays. 'vs' columns: peer "
        "time / this system's time (> 1: faster than the peer; vs_triton_kernels: its bf16 x mxfp4). GB/s counts A, all of B (with scales) and the bf16 output once; "
        "'weight GB/s' counts B alone (the decode regime's floor). 'rel err vs bf16': against the "
        "bf16 peer's output, a sanity check (tests/ hold the exact ones)."
    )
    print(write_table(rows, out_dir, "grouped_matmul", "Grouped MoE matmul: tokens-per-expert sweep", header))
    if routing:
        print(write_table(routing, out_dir, "routing", "Imbalanced and half-empty routing at equal tokens", header))
    print(write_table(quantize_rows(ceilings), out_dir, "quantize", "Activation quantize kernel", header))
    for regime, metric, keep in (
        ("decode", "weight GB/s", lambda t: t <= DECODE_MAX),
        ("compute", "TFLOP/s", lambda t: t >= COMPUTE_MIN),
    ):
        panels = {}
        for r in rows:
            if keep(r["tokens/expert"]):
                panels.setdefault(r["model"], {}).setdefault(r["system"], []).append((r["tokens/expert"], r[metric]))
        line_plots(
            panels,
            "tokens per expert",
            metric,
            os.path.join(out_dir, f"grouped_matmul_{regime}.png"),
            f"Grouped matmul, {regime} regime, {gpu}",
        )


if __name__ == "__main__":
    main()
