"""The benchmark scripts: each runs llmkernels and its peers in one run on the GPU and writes markdown,
CSV and PNG under ``benchmarks/results/<gpu>/``. They import the installed library (or ``PYTHONPATH=src``)
and share ``common`` (timers, ceilings, tables, plots) and ``peers`` (SDPA, FlexAttention).

Run one from the repository root: ``python -m benchmarks <suite> [its arguments]``; ``python -m benchmarks``
lists the suites.
"""
