"""`make bench`: run every benchmark, print a table of ratios and write bench/results.json.

Each case is {"name", "value", "baseline", "ratio", "target", "met"}: value and baseline measured in this run,
ratio = value / baseline (higher is better unless the case says otherwise), met = ratio against target.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from pathlib import Path

SUITES = {
    "conversion": "bench.bench_conversion",
    "input": "bench.bench_input",
    "planning": "bench.bench_planning",
    "training": "bench.bench_training",
    "orchestration": "bench.bench_orchestration",
    "ray": "bench.bench_ray",
}
RESULTS = Path(__file__).resolve().parent / "results.json"


def print_table(cases: list[dict]) -> None:
    header = f"{'case':<52} {'value':>14} {'baseline':>14} {'ratio':>8} {'target':>8}  met"
    print(header)
    print("-" * len(header))
    for c in cases:
        print(f"{c['name']:<52} {c['value']:>14.4g} {c['baseline']:>14.4g} {c['ratio']:>8.2f} "
              f"{c['target']:>8.2f}  {'yes' if c['met'] else 'NO'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("suites", nargs="*", default=list(SUITES), help=f"which suites (default all): {list(SUITES)}")
    parser.add_argument("--rows", type=int, default=None,
                        help="generated rows for the conversion and input cases (default: each suite's own, "
                             "2,000,000 for conversion and 1,000,000 for input)")
    parser.add_argument("--width", type=int, default=None, help="float columns per generated row (default 32)")
    parser.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

    cases: list[dict] = []
    for name in args.suites:
        module = importlib.import_module(SUITES[name])
        start = time.perf_counter()
        print(f"\n=== {name} ===", flush=True)
        sizes = {key: value for key, value in (("rows", args.rows), ("width", args.width)) if value is not None}
        got = module.run(quick=args.quick, **sizes)
        cases += got
        print(f"({name}: {time.perf_counter() - start:.1f}s)")
    print()
    print_table(cases)
    previous = json.loads(RESULTS.read_text()).get("cases", []) if RESULTS.exists() else []
    names = {c["name"] for c in cases}
    merged = [c for c in previous if c["name"] not in names] + cases
    RESULTS.write_text(json.dumps({"cases": merged}, indent=2) + "\n")
    print(f"\nwrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
