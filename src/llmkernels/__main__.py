"""``python -m llmkernels demo``: runs each kernel family on a default problem, checks it against the
PyTorch reference and prints timings. Without a GPU it runs small problems through Triton's
interpreter (and says so)."""

from __future__ import annotations

import argparse
import os
import sys

import torch


def _ensure_interpreter_without_gpu() -> None:
    """Triton decides at decoration time whether kernels are interpreted, i.e. when llmkernels was
    imported (which ``python -m`` did before this module ran): restart with the interpreter on."""
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        return
    os.environ["TRITON_INTERPRET"] = "1"
    os.execv(sys.executable, [sys.executable, "-m", "llmkernels", *sys.argv[1:]])


def _families():
    from .grouped_matmul.demo import run_demo as grouped_matmul_demo

    families = {"grouped_matmul": grouped_matmul_demo}
    try:
        from .attention.demo import run_demo as attention_demo
    except ImportError:
        pass
    else:
        families["attention"] = attention_demo
    return families


def demo(selected: list[str]) -> int:
    from .testing import default_device

    device = default_device()
    if device.type == "cuda":
        print(f"llmkernels demo on {torch.cuda.get_device_name(device)}")
    else:
        print(
            "llmkernels demo: no CUDA GPU, so small problems run through the Triton interpreter on the CPU "
            "(correctness only, no timings)"
        )
    families = _families()
    failures = 0
    for name in selected or list(families):
        if name not in families:
            print(f"unknown kernel family {name!r}; choose from {sorted(families)}")
            return 2
        print(f"\n== {name} ==")
        print(f"{'kernel':<44} {'problem':<36} {'rel error':>10} {'check':>6} {'time':>10}")
        for row in families[name](device):
            time = f"{row['time_ms'] * 1e3:.1f} us" if row.get("time_ms") is not None else "-"
            check = "ok" if row["ok"] else "FAIL"
            failures += not row["ok"]
            print(f"{row['kernel']:<44} {row['problem']:<36} {row['rel_error']:>10.2e} {check:>6} {time:>10}")
    print("\nall checks passed" if not failures else f"\n{failures} check(s) FAILED")
    return 1 if failures else 0


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m llmkernels", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    demo_parser = commands.add_parser("demo", help="run, check and time each kernel family on a default problem")
    demo_parser.add_argument("families", nargs="*", help="kernel families to run (default: all)")
    args = parser.parse_args()
    _ensure_interpreter_without_gpu()
    return demo(args.families)


if __name__ == "__main__":
    sys.exit(main())
