"""The benchmark suites: each ``bench_*`` module runs llmkernels and its peers in one run on the GPU and writes
markdown, CSV and PNG to ``benchmarks/results/<gpu>/<suite>/``, which holds the latest results of that suite on that
GPU. They import the installed library (or ``PYTHONPATH=src``) and share ``common`` (timers, ceilings, tables,
plots, the GPU check) and ``peers`` (SDPA, FlexAttention, the other libraries' kernels).

Run one from the repository root: ``python -m benchmarks <suite> [its arguments]``; ``python -m benchmarks`` lists
the suites with what each measures. A suite that cannot run on this machine (no suitable GPU) says so in one line
and exits with status 2. Ablations, profiler targets and the tuning log are the experiment record in ``lab/``.
"""
