"""Conversion by this tree against an older commit's, interleaved (A/B): did a change cost speed?

    python -m bench.ab_conversion REF [--rows N] [--repeats R] [--out FILE]

REF (a commit, tag or branch) is checked out into a temporary git worktree and its C extension built in place
there; both trees then convert the same sources (the conversion cases of `bench_conversion`: Parquet with a list
column, wide Parquet, .npz, CSV and gzip CSV), each conversion in a fresh process that imports only its own tree,
the two trees alternating (which goes first alternates each round). Each side's median and spread are printed, and
the ratio new/old of the medians (above 1: the new tree is faster). The old tree's conversion version may differ:
the shard bytes are not compared here (the tests do that), only the time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import bench_conversion

ROOT = Path(__file__).resolve().parent.parent

_TIMED = """
import json, sys, time
from pipeline_lib.config import DataConfig
from pipeline_lib.data.convert import convert
data = DataConfig(source=sys.argv[1], label="label", target_shard_mb=64, **json.loads(sys.argv[3]))
start = time.perf_counter()
convert(data, sys.argv[2])
print(json.dumps({"seconds": time.perf_counter() - start}))
"""

# Builds a tree's `_native` extension in place, from that tree's own sources (as its pyproject.toml lists them).
_BUILD = """
import tomllib, sys
from setuptools import Extension, setup
spec = tomllib.load(open("pyproject.toml", "rb"))["tool"]["setuptools"]["ext-modules"][0]
setup(name="ab", script_args=["build_ext", "--inplace", "-q"],
      ext_modules=[Extension(spec["name"], spec["sources"], extra_compile_args=spec.get("extra-compile-args", []))])
"""


def _tree(ref: str, where: Path) -> Path:
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(where), ref], check=True,
                   capture_output=True)
    subprocess.run([sys.executable, "-c", _BUILD], cwd=where, check=True, capture_output=True)
    return where


def _convert_seconds(tree: Path, source: str, out: str, options: dict) -> float:
    shutil.rmtree(out, ignore_errors=True)
    os.sync()
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run([sys.executable, "-c", _TIMED, source, out, json.dumps(options)], cwd=tree, env=env,
                          check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])["seconds"]


def run(ref: str, rows: int, width: int, repeats: int) -> list[dict]:
    work = Path(tempfile.mkdtemp(prefix="tfdag-ab-"))
    old = _tree(ref, work / "old")
    try:
        sources = {"parquet": str(work / "x.parquet"), "wide parquet": str(work / "wide.parquet"),
                   "npz": str(work / "x.npz"), "csv": str(work / "x.csv"), "csv.gz": str(work / "x.csv.gz")}
        bench_conversion.write_source(sources["parquet"], rows, width)
        bench_conversion.write_source(sources["wide parquet"], rows, width, wide=True)
        bench_conversion.write_npz(sources["npz"], sources["parquet"])
        bench_conversion.write_csv(sources["csv"], max(1, rows // 4), width)
        bench_conversion.write_gzip(sources["csv.gz"], sources["csv"])
        results = []
        for name, source in sources.items():
            samples: dict[str, list[float]] = {"old": [], "new": []}
            trees = {"old": old, "new": ROOT}
            for tree in trees.values():  # one warm-up each: the page cache holds the source for both
                _convert_seconds(tree, source, str(work / "out"), {})
            for round_ in range(repeats):
                for side in (["old", "new"] if round_ % 2 == 0 else ["new", "old"]):
                    samples[side].append(_convert_seconds(trees[side], source, str(work / "out"), {}))
            old_median, new_median = statistics.median(samples["old"]), statistics.median(samples["new"])
            results.append({"case": f"conversion from {name}", "ref": ref, "old_seconds": old_median,
                            "old_spread": [min(samples["old"]), max(samples["old"])], "new_seconds": new_median,
                            "new_spread": [min(samples["new"]), max(samples["new"])],
                            "new_vs_old": old_median / new_median, "repetitions": repeats})
            print(json.dumps(results[-1]), flush=True)
        return results
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)], capture_output=True,
                       check=False)
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.ab_conversion", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("ref", help="the commit to compare with (e.g. the last one before a change)")
    parser.add_argument("--rows", type=int, default=2_000_000, help="Parquet and .npz rows (CSV: a quarter)")
    parser.add_argument("--width", type=int, default=32, help="float columns per row")
    parser.add_argument("--repeats", type=int, default=7, help="interleaved rounds")
    parser.add_argument("--out", type=Path, default=None, help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    results = run(args.ref, args.rows, args.width, args.repeats)
    if args.out:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        record = {"command": f"python -m bench.ab_conversion {args.ref} --repeats {args.repeats}", "old": args.ref,
                  "new": head, "date": time.strftime("%Y-%m-%d"),
                  "note": "each conversion in a fresh process, the two trees alternating; medians and min-max of "
                          f"{args.repeats} rounds; new_vs_old = old/new of the medians (above 1: the new tree is "
                          "faster)", "cases": results}
        args.out.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
