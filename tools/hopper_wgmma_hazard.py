"""GPU check of the Hopper-layout grouped matmul's tiles: runs each on model-like shapes five times and
reports the relative error against the float32 product of the dequantized weights and whether the runs agree
bit for bit (a race in the compiled pipeline shows as NaN/inf and runs that differ).

    PYTHONPATH=src python tools/hopper_wgmma_hazard.py [--timing] [--tiles default,...] [--shapes 0,1]

Written for a wrong tile found in session 11 (128x128x64, 4 warps: NaN and run-to-run differences on the
H100 with Triton 3.6, under ptxas 12.8 and 13.4 alike). Session 12 found the cause: Triton 3.6 leaves a K
step's register-operand wgmmas in flight while the next step's decode writes their A registers
(triton-lang/triton#9433; ``tools/sass_hazards.py`` shows it in the SASS, ``kernel.retire_mma`` is the
fix). Run it under another assembler with ``TRITON_PTXAS_PATH`` and a fresh ``TRITON_CACHE_DIR``.
Figures: ``lab/NOTES.md`` (the experiment record).
"""

from __future__ import annotations

import argparse
import inspect
import subprocess

import torch
import triton

import llmkernels as lk
from llmkernels.grouped_matmul import config as gm_config

TILES = {  # name: (block_m, block_n, block_k, warps, stages); None = the default of the shape
    "default": None,
    "16x128x128": (16, 128, 128, 4, 3),
    "64x128x128": (64, 128, 128, 4, 3),
    "128x128x128": (128, 128, 128, 4, 3),
    "128x128x64": (128, 128, 64, 4, 3),
    "128x128x64 s4": (128, 128, 64, 4, 4),
    "256x128x64 w8": (256, 128, 64, 8, 3),
    "128x256x64 w8": (128, 256, 64, 8, 3),
    "256x128x128 w8 s2": (256, 128, 128, 8, 2),
    "16x128x128 s4": (16, 128, 128, 4, 4),
    "16x256x128 w8": (16, 256, 128, 8, 3),
    "64x256x128 w8": (64, 256, 128, 8, 3),
    "128x128x128 s2": (128, 128, 128, 4, 2),
    "128x256x128 w8 s2": (128, 256, 128, 8, 2),
    "128x256x128 w8 s3": (128, 256, 128, 8, 3),
    "64x128x128 s2": (64, 128, 128, 4, 2),
    "32x128x128": (32, 128, 128, 4, 3),
    "16x128x128 s3": (16, 128, 128, 4, 3),
    "16x64x128 s4": (16, 64, 128, 4, 4),
    "64x64x128": (64, 64, 128, 4, 3),
}
SHAPES = (
    (8, 4096, 7168, 2048),
    (128, 4096, 7168, 256),
    (32, 5760, 2880, 64),
    (128, 4096, 7168, 1),
    (128, 4096, 7168, 64),
    (256, 7168, 2048, 16),
)


def _assembler() -> str:
    from triton.backends.nvidia import compiler

    tool = (
        compiler.get_ptxas(90) if "arch" in inspect.signature(compiler.get_ptxas).parameters else compiler.get_ptxas()
    )
    version = subprocess.check_output([tool.path, "--version"]).decode().strip().splitlines()[-1]
    return f"{tool.path}: {version}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timing", action="store_true", help="also time each tile (CUDA-graph replay)")
    parser.add_argument("--tiles", default=",".join(TILES), help="comma-separated names of TILES")
    parser.add_argument("--shapes", default="0,1,2,3,4,5", help="comma-separated indices into SHAPES")
    parser.add_argument("--formats", default="mxfp4,nvfp4")
    args = parser.parse_args()
    tiles = {name: TILES[name] for name in args.tiles.split(",")}
    print(f"# {torch.cuda.get_device_name()}, Triton {triton.__version__}, ptxas for sm_90: {_assembler()}")
    torch.manual_seed(0)
    for experts, n, k, tokens in (SHAPES[int(i)] for i in args.shapes.split(",")):
        w = torch.randn(experts, n, k, device="cuda") * k**-0.5
        for fmt in args.formats.split(","):
            q = lk.quantize(w, fmt)
            hopper, w_ref = q.to_layout("hopper"), lk.dequantize(q)
            del q
            x = torch.randn(experts * tokens, k, device="cuda", dtype=torch.bfloat16)
            offsets = torch.arange(experts + 1, dtype=torch.int32, device="cuda") * tokens
            ids = torch.arange(experts, dtype=torch.int32, device="cuda")
            expected = torch.bmm(x.view(experts, tokens, k).float(), w_ref.transpose(1, 2)).view(-1, n)
            for epilogue in (None, "swiglu"):
                if epilogue == "swiglu":
                    gate, up = expected[:, : n // 2], expected[:, n // 2 :]
                    reference = torch.nn.functional.silu(gate) * up
                else:
                    reference = expected
                for name, tile in tiles.items():
                    if tile is None:
                        config = None
                    else:
                        bm, bn, bk, warps, stages = tile
                        if epilogue == "swiglu":
                            bn //= 2
                        if bn < 64:  # refused by the product on the GPU (32-row SwiGLU halves were wrong)
                            continue
                        config = lk.BlockScaledMatmulConfig(
                            bm, bn, bk, num_stages=stages, num_warps=warps, ab_swapped=True, mma="dequant"
                        )
                    run = lambda: lk.grouped_matmul(
                        x,
                        hopper,
                        offsets,
                        ids,
                        epilogue=epilogue,  # noqa: E731
                        config=config,
                    )
                    outs = [run().float() for _ in range(5)]
                    errors = [((o - reference).norm() / reference.norm()).item() for o in outs]
                    same = all(torch.equal(o, outs[0]) for o in outs[1:])
                    shown = config or gm_config.hopper_config(
                        experts * tokens, experts, x.device, epilogue == "swiglu", hopper.spec.block
                    )
                    line = (
                        f"E={experts} N={n} K={k} T={tokens} {fmt} {epilogue or 'plain'} {name} "
                        f"({shown.block_m}x{shown.block_n}x{shown.block_k} w{shown.num_warps} "
                        f"s{shown.num_stages}): max rel err {max(errors):.2e}, runs equal {same}"
                    )
                    if args.timing:
                        from benchmarks.common import graph_time_ms

                        line += f", {graph_time_ms(run) * 1e3:.1f} us"
                    print(line + ("" if max(errors) < 1e-2 and same else "  <-- WRONG"), flush=True)
            del hopper, w_ref, x, expected, reference, outs
            torch.cuda.empty_cache()
        del w
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
