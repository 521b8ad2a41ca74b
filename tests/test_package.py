"""The package as users import it: names reachable both as functions and as packages."""

import importlib

import llmkernels
import llmkernels as lk


def test_attention_and_grouped_matmul_are_functions_and_packages():
    from llmkernels.attention import FA4Config, PagedKVCache
    from llmkernels.grouped_matmul import BlockScaledMatmulConfig

    assert callable(lk.attention) and callable(lk.grouped_matmul)
    assert llmkernels.attention.FA4Config is FA4Config and lk.attention.PagedKVCache is PagedKVCache
    assert lk.grouped_matmul.BlockScaledMatmulConfig is BlockScaledMatmulConfig
    assert lk.attention.config is importlib.import_module("llmkernels.attention.config")
    for name in ("attention", "grouped_matmul"):
        package = importlib.import_module(f"llmkernels.{name}")
        missing = [public for public in package.__all__ if not hasattr(getattr(lk, name), public)]
        assert not missing, f"llmkernels.{name}.{missing} unreachable through the function"


def test_python_m_benchmarks_lists_every_suite_with_a_line_and_exits_0():
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    listing = subprocess.run(
        [sys.executable, "-m", "benchmarks"], cwd=root, capture_output=True, text=True, timeout=120
    )
    assert listing.returncode == 0, listing.stderr
    lines = {line.split()[0]: line for line in listing.stdout.splitlines() if line.startswith("  bench_")}
    suites = {path.stem for path in (root / "benchmarks").glob("bench_*.py")}
    assert set(lines) == suites
    assert all(len(line.split()) > 4 for line in lines.values()), "each suite says what it measures"
