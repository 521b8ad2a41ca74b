"""Tile ablation of the activation quantize kernel: bytes moved per second against the copy ceiling.

    python -m benchmarks ablate_quantize [--out DIR]

Each tile's output is checked bit for bit against the default tile's before it is timed.
"""
from __future__ import annotations

import argparse
import itertools

import torch

from benchmarks.common import default_out_dir, measure_ceilings, time_ms, write_table  # noqa: E402

import llmkernels as lk  # noqa: E402
from llmkernels.formats import api  # noqa: E402

BYTES_OUT = {"mxfp8": 1 + 1 / 32, "mxfp4": 0.5 + 1 / 32, "nvfp4": 0.5 + 1 / 16}
TILES = list(itertools.product((8, 16, 32, 64), (64, 128, 256), (4, 8)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    ceilings = measure_ceilings()
    rows = []
    for tokens, k in ((16384, 7168), (4096, 2880)):
        x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
        for fmt in ("mxfp8", "mxfp4", "nvfp4"):
            expected = lk.quantize(x, fmt)
            global_scale = expected.global_scale
            for tile in TILES:
                if tile[0] * tile[1] < 32 * tile[2]:
                    continue
                api.QUANTIZE_TILE = tile
                out = lk.quantize(x, fmt, global_scale=global_scale)
                same = torch.equal(out.data.view(torch.uint8), expected.data.view(torch.uint8)) and torch.equal(
                    out.scales.view(torch.uint8), expected.scales.view(torch.uint8))
                ms = time_ms(lambda: lk.quantize(x, fmt, global_scale=global_scale)) if same else float("nan")
                moved = tokens * k * (2 + BYTES_OUT[fmt])
                rows.append({"tokens": tokens, "K": k, "format": fmt, "rows": tile[0], "cols": tile[1],
                             "warps": tile[2], "us": ms * 1e3, "GB/s": moved / ms / 1e6,
                             "% copy BW": 100 * moved / ms / 1e6 / ceilings["copy_gbps"], "bits equal": same})
        del x
    best = {}
    for r in rows:
        key = (r["tokens"], r["format"])
        if r["GB/s"] == r["GB/s"] and (key not in best or r["GB/s"] > best[key]["GB/s"]):
            best[key] = r
    print(write_table(list(best.values()), args.out or default_out_dir(), "ablate_quantize_best",
                      "Best quantize tile per format and shape", f"{torch.cuda.get_device_name()}; {ceilings}"))
    write_table(rows, args.out or default_out_dir(), "ablate_quantize", "Quantize kernel tiles",
                f"{torch.cuda.get_device_name()}; ceilings {ceilings}")


if __name__ == "__main__":
    main()
