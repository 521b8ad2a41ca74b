"""``python -m benchmarks``: lists the suites, one line each on what it measures; ``python -m benchmarks <suite>
[arguments]`` runs that suite's ``main`` with its arguments (``<suite> --help`` shows them)."""

import ast
import importlib
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
SUITES = sorted(path.stem for path in HERE.glob("bench_*.py"))


def summary(suite: str) -> str:
    """The first line of the suite's docstring, read without importing it (no torch, no GPU)."""
    doc = ast.get_docstring(ast.parse((HERE / f"{suite}.py").read_text(encoding="utf-8"))) or ""
    return doc.strip().splitlines()[0] if doc.strip() else ""


def listing() -> str:
    width = max(map(len, SUITES))
    lines = [f"  {suite:{width}}  {summary(suite)}" for suite in SUITES]
    return (
        "usage: python -m benchmarks <suite> [arguments]   (<suite> --help: its arguments)\n\nsuites (results: "
        "benchmarks/results/<gpu>/<suite>/; a suite that needs a GPU says so and exits with status 2):\n"
        + "\n".join(lines)
    )


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(listing())
        return
    suite = sys.argv[1]
    if suite not in SUITES:
        print(f"no suite named {suite!r}\n\n{listing()}", file=sys.stderr)
        sys.exit(2)
    sys.argv = [f"benchmarks {suite}", *sys.argv[2:]]
    importlib.import_module(f"benchmarks.{suite}").main()


if __name__ == "__main__":
    main()
