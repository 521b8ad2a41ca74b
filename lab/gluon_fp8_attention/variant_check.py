"""Offline sm_90a compile of the softmax variants of fp8_attention.py (cond_rescale, poly_fraction) and SASS
counts of the consumer's key-tile loops.

    python lab/gluon_fp8_attention/variant_check.py [--quick] [--sass DIR]

Per variant: registers (launch), spills (ptxas -v), STL / LDL inside the step loops, tools/sass_hazards.py,
and for each consumer warpgroup's innermost fused step loops (8 QGMMA each: S_{j+1} and P_j V_j, 4 k32 steps
apiece at D = 128) the instruction counts per warp and key tile: the unmasked loop (the band) and the masked one
(tile 0 / causal diagonal / key tail). With cond_rescale the loop holds a forward branch around the rescale
block (alpha's MUFU.EX2 and O's 64 FMUL): its instructions are counted apart ("rescale block", executed only
when the reference moves) and left out of the loop's counts ("common path"). Run with TRITON_INTERPRET unset.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

os.environ["TRITON_INTERPRET"] = "0"
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from compile_check import inspect  # noqa: E402
from fp8_attention import compile_for_sm90  # noqa: E402

# (label, head_dim, causal, keyword arguments of compile_for_sm90)
VARIANTS = [
    ("default", 128, False, {}),
    ("cond rescale", 128, False, dict(cond_rescale=True)),
    ("poly 1/8", 128, False, dict(poly_fraction=0.125)),
    ("cond rescale + poly 1/8", 128, False, dict(cond_rescale=True, poly_fraction=0.125)),
    ("cond rescale + poly 1/4", 128, False, dict(cond_rescale=True, poly_fraction=0.25)),
    ("3 stages + cond rescale + poly 1/8", 128, False, dict(stages=3, cond_rescale=True, poly_fraction=0.125)),
    ("ping-pong + cond rescale + poly 1/8", 128, False, dict(pingpong=True, cond_rescale=True, poly_fraction=0.125)),
    ("default", 128, True, {}),
    ("cond rescale", 128, True, dict(cond_rescale=True)),
    ("poly 1/8", 128, True, dict(poly_fraction=0.125)),
    ("cond rescale + poly 1/8", 128, True, dict(cond_rescale=True, poly_fraction=0.125)),
    ("cond rescale + poly 1/4", 128, True, dict(cond_rescale=True, poly_fraction=0.25)),
    ("3 stages + cond rescale + poly 1/8", 128, True, dict(stages=3, cond_rescale=True, poly_fraction=0.125)),
    ("default", 64, False, {}),
    ("cond rescale + poly 1/8", 64, False, dict(cond_rescale=True, poly_fraction=0.125)),
    ("default", 64, True, {}),
    ("cond rescale + poly 1/8", 64, True, dict(cond_rescale=True, poly_fraction=0.125)),
]
QUICK = {("default", 128, False), ("cond rescale + poly 1/8", 128, False)}

CATEGORIES = {
    "EX2": r"^MUFU\.EX2",
    "FMUL": r"^FMUL\b",
    "FFMA": r"^FFMA\b",
    "FADD": r"^FADD\b",
    "FMNMX": r"^FMNMX\b",
    "F2FP": r"^F2FP\.",
    "int": r"^(?:IMAD|LEA|SHF|IADD3|LOP3|SEL)\b",
    "SHFL": r"^SHFL\.",
    "BAR": r"^BAR\.SYNC",
    "QGMMA": r"^QGMMA\.",
    "STL/LDL": r"^(?:STL|LDL)\b",
}


def parse(sass: str) -> list:
    """[(address, predicate, opcode text)] of the SASS (one kernel)."""
    out = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?(.*?)\s*;", line)
        if m:
            out.append((int(m.group(1), 16), (m.group(2) or "").strip(), m.group(3).strip()))
    return out


def counts(body) -> dict:
    result = {key: sum(bool(re.search(p, text)) for _, _, text in body) for key, p in CATEGORIES.items()}
    result["all"] = len(body)
    return result


def step_loops(sass: str, qgmma: int = 8) -> list:
    """The innermost loops (a backward branch, no other backward branch inside) with ``qgmma`` QGMMA (one fused
    step: D / 32 for S, keys / 32 for P V): for each, its
    address range, common-path counts and the counts of forward-branched blocks holding MUFU.EX2 and >= 32 FMUL
    (cond_rescale's rescale block)."""
    ins = parse(sass)
    backs = []
    for addr, _, text in ins:
        b = re.match(r"BRA\s+(?:`\()?.*?0x([0-9a-f]+)", text)
        if b and int(b.group(1), 16) < addr:
            backs.append((int(b.group(1), 16), addr))
    loops = []
    for lo, hi in backs:
        if any(lo <= a < b <= hi and (a, b) != (lo, hi) for a, b in backs):
            continue
        body = [x for x in ins if lo <= x[0] <= hi]
        if counts(body)["QGMMA"] != qgmma:
            continue
        blocks = []
        for addr, pred, text in body:
            b = re.match(r"BRA\s+.*?0x([0-9a-f]+)", text)
            if pred and b and addr < int(b.group(1), 16) <= hi:
                skipped = [x for x in body if addr < x[0] < int(b.group(1), 16)]
                c = counts(skipped)
                if c["EX2"] and c["FMUL"] >= 32:
                    blocks.append((addr, int(b.group(1), 16), c))
        skipped_addrs = {x[0] for x in body for a, t, _ in blocks if a < x[0] < t}
        common = counts([x for x in body if x[0] not in skipped_addrs])
        loops.append(dict(range=(lo, hi), common=common, blocks=[c for _, _, c in blocks]))
    return loops


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two variants only")
    parser.add_argument("--sass", default="", help="write each variant's SASS into this folder")
    parser.add_argument("--head-dim", type=int, default=0, help="only this D")
    args = parser.parse_args()
    failed = False
    header = (
        "| D | mask | variant | regs | spills st/ld B | STL/LDL in loops | hazards | loop | all | EX2 | FMUL | FFMA "
        "| FADD | FMNMX | F2FP | int | BAR | rescale block (all / EX2 / FMUL) |"
    )
    print(header)
    print("|" + " --- |" * (header.count("|") - 1))
    for label, head_dim, causal, kw in VARIANTS:
        if (args.quick and (label, head_dim, causal) not in QUICK) or args.head_dim not in (0, head_dim):
            continue
        try:
            result = inspect(compile_for_sm90(head_dim, causal, **kw))
        except Exception as error:  # noqa: BLE001
            failed = True
            mask = "causal" if causal else "full"
            print(f"| {head_dim} | {mask} | {label} | COMPILE ERROR {type(error).__name__}: {str(error)[:500]} |")
            continue
        if args.sass:
            os.makedirs(args.sass, exist_ok=True)
            name = re.sub(r"[^a-z0-9]+", "_", f"d{head_dim} {'causal' if causal else 'full'} {label}".lower())
            with open(os.path.join(args.sass, name + ".sass"), "w") as file:
                file.write(result["sass"])
        tile_n = 64 if head_dim == 256 else 128
        loops = step_loops(result["sass"], head_dim // 32 + tile_n // 32)
        in_loops = sum(loop["common"]["STL/LDL"] + sum(b["STL/LDL"] for b in loop["blocks"]) for loop in loops)
        if any("e4m3.e4m3" not in kind for kind in result["wgmma"]) or result["warnings"]:
            failed = True
        # consumer 0's and consumer 1's loops come in code order, two each: unmasked (the shorter) and masked
        for n, loop in enumerate(loops):
            c, blocks = loop["common"], loop["blocks"]
            pair = [x["common"]["all"] for x in loops[n - n % 2 : n - n % 2 + 2]]
            kind = f"c{n // 2} {'unmasked' if c['all'] == min(pair) else 'masked'}"
            block = " + ".join(f"{b['all']} / {b['EX2']} / {b['FMUL']}" for b in blocks) or "-"
            head = [head_dim, "causal" if causal else "full", label, result["registers"], result["spills"], in_loops]
            head = [*head, result["hazards"]] if n == 0 else [""] * 7
            cells = [kind, *(c[k] for k in ("all", "EX2", "FMUL", "FFMA", "FADD", "FMNMX", "F2FP", "int", "BAR"))]
            print("| " + " | ".join(str(x) for x in [*head, *cells, block]) + " |", flush=True)
        if result["warnings"]:
            print(f"|  |  | ptxas warnings: {'; '.join(result['warnings'])} |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
