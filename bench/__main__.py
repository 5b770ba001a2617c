"""`make bench`: run every benchmark, print a table of ratios and write bench/results.json.

results.json is this run alone, written whole: the git commit, the date, the machine (cores, memory, load average
at start and end) and the cases (bench/__init__.py: `case`, `budget`, `not_run`). A suite that fails is recorded
as not run, with the error. `python -m bench.table` prints the README's table from it.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from bench import not_run

SUITES = {
    "conversion": "bench.bench_conversion",
    "input": "bench.bench_input",
    "planning": "bench.bench_planning",
    "training": "bench.bench_training",
    "orchestration": "bench.bench_orchestration",
    "ray": "bench.bench_ray",
    "scale": "bench.bench_scale",
    "scoring": "bench.bench_scoring",
    "tuning": "bench.bench_tuning",
    "elastic": "bench.bench_elastic",
    "resume": "bench.bench_resume",
    "ray_data": "bench.bench_ray_data",
}
RESULTS = Path(__file__).resolve().parent / "results.json"


def print_table(cases: list[dict]) -> None:
    header = f"{'case':<64} {'value':>12} {'baseline':>12} {'ratio':>7} {'target':>7}  met"
    print(header)
    print("-" * len(header))
    for c in cases:
        if c.get("status") == "not run":
            print(f"{c['name']:<64} not run: {c['reason']}")
        elif c.get("kind") == "report":
            print(f"{c['name']:<64} {c['value']:>12.4g} {'(reported)':>12}")
        elif c.get("kind") == "budget":
            print(f"{c['name']:<64} {c['value']:>12.4g} {'(budget)':>12} {'':>7} {c['target']:>7.2f}  "
                  f"{'yes' if c['met'] else 'NO'}")
        elif c.get("target") is None:
            print(f"{c['name']:<64} {c['value']:>12.4g} {c['baseline']:>12.4g} {c['ratio']:>7.2f} {'-':>7}  reported")
        else:
            print(f"{c['name']:<64} {c['value']:>12.4g} {c['baseline']:>12.4g} {c['ratio']:>7.2f} "
                  f"{c['target']:>7.2f}  {'yes' if c['met'] else 'NO'}")


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=RESULTS.parent.parent, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def machine() -> dict:
    """Cores, memory and CPU of this machine (the load average is added at the start and the end of the run)."""
    import psutil

    model = ""
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as handle:
            model = next((line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")), "")
    return {"cpu_count": os.cpu_count(),
            "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "cpu_model": model, "memory_gb": round(psutil.virtual_memory().total / 1e9, 1),
            "platform": platform.platform(), "python": platform.python_version()}


def _run_suite(name: str, quick: bool, sizes: dict[str, int]) -> list[dict]:
    """The suite's cases, or one not-run case naming the error it failed with."""
    try:
        return importlib.import_module(SUITES[name]).run(quick=quick, **sizes)
    except Exception as error:  # noqa: BLE001  (one suite's failure is recorded; the others still run)
        traceback.print_exc()
        return [not_run(f"{name} suite", f"failed: {type(error).__name__}: {' '.join(str(error).split())}")]


def _run_suite_in_its_own_process(name: str, quick: bool, sizes: dict[str, int]) -> list[dict]:
    """The suite run by a fresh `python -m bench`: no suite inherits another's TensorFlow state, threads or memory
    (the ray suite configures TensorFlow's devices, which a process can do only before it first uses them)."""
    with tempfile.TemporaryDirectory() as directory:
        out = Path(directory, "cases.json")
        command = [sys.executable, "-m", "bench", name, "--cases-to", str(out), *(["--quick"] if quick else []),
                   *(f"--{key}={value}" for key, value in sizes.items())]
        done = subprocess.run(command, cwd=RESULTS.parent.parent, check=False)
        if done.returncode != 0 or not out.exists():
            return [not_run(f"{name} suite", f"its process exited with {done.returncode} (output above)")]
        return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("suites", nargs="*", default=list(SUITES), help=f"which suites (default all): {list(SUITES)}")
    parser.add_argument("--rows", type=int, default=None,
                        help="generated rows for the conversion, input and scale cases (default: each suite's own, "
                             "2,000,000 for conversion, 1,000,000 for input, 10,000,000 for scale)")
    parser.add_argument("--width", type=int, default=None, help="float columns per generated row (default 32)")
    parser.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    parser.add_argument("--in-process", action="store_true",
                        help="run the suites in this process instead of one fresh process each")
    parser.add_argument("--cases-to", type=Path, default=None, help=argparse.SUPPRESS)  # a suite's own process
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sizes = {key: value for key, value in (("rows", args.rows), ("width", args.width)) if value is not None}
    if args.cases_to is not None:
        args.cases_to.write_text(json.dumps([case for name in args.suites
                                             for case in _run_suite(name, args.quick, sizes)]))
        return 0

    run_info = {"commit": _git("rev-parse", "HEAD"), "uncommitted_changes": bool(_git("status", "--porcelain")),
                "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                "command": " ".join(["python -m bench", *(argv if argv is not None else sys.argv[1:])]),
                "quick": args.quick, "machine": machine(), "load_average_start": list(os.getloadavg())}
    cases: list[dict] = []
    suite_seconds: dict[str, float] = {}
    for name in args.suites:
        start = time.perf_counter()
        print(f"\n=== {name} ===", flush=True)
        if args.in_process:
            cases += _run_suite(name, args.quick, sizes)
        else:
            cases += _run_suite_in_its_own_process(name, args.quick, sizes)
        suite_seconds[name] = round(time.perf_counter() - start, 1)
        print(f"({name}: {suite_seconds[name]:.1f}s)")
    print()
    print_table(cases)
    run_info.update(load_average_end=list(os.getloadavg()), suite_seconds=suite_seconds, cases=cases)
    RESULTS.write_text(json.dumps(run_info, indent=2) + "\n")  # this run alone: nothing of earlier runs is kept
    print(f"\nwrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
