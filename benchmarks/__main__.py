"""``python -m benchmarks <suite> [arguments]``: runs one benchmark script's ``main`` with its arguments."""
import importlib
import pkgutil
import sys

import benchmarks

SUITES = sorted(module.name for module in pkgutil.iter_modules(benchmarks.__path__)
                if module.name.startswith(("bench_", "ablate_", "profile_")))


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in SUITES:
        sys.exit("usage: python -m benchmarks <suite> [arguments]\nsuites: " + ", ".join(SUITES))
    suite = sys.argv[1]
    sys.argv = [f"benchmarks {suite}", *sys.argv[2:]]
    importlib.import_module(f"benchmarks.{suite}").main()


if __name__ == "__main__":
    main()
