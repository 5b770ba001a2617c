"""`python -m bench.table [--write]`: the docs' performance table, printed from bench/results.json.

With `--write` the table replaces the lines between docs/performance.md's `<!-- bench-table:start -->` and
`<!-- bench-table:end -->` markers, so the docs never show a number that results.json does not hold (a test keeps
the page fresh).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.__main__ import RESULTS

README = RESULTS.parent.parent / "docs" / "performance.md"
START, END = "<!-- bench-table:start -->", "<!-- bench-table:end -->"


def _number(value: float) -> str:
    if value == 0:
        return "0"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.3g}"


def _with_spread(value: float, spread: list[float] | None) -> str:
    if not spread or spread[0] == spread[1]:
        return _number(value)
    return f"{_number(value)} ({_number(spread[0])}–{_number(spread[1])})"


def _row(case: dict) -> str:
    name = case["name"]
    if case.get("status") == "not run":
        return f"| {name} | not run | | | | | {case['reason']} |"
    unit = f" {case['unit']}" if case.get("unit") else ""
    tfdag = _with_spread(case["value"], case.get("value_spread")) + unit
    if case.get("kind") == "report":
        return f"| {name} | {tfdag} | reported | | | | {case.get('bound', '')} |"
    if case.get("kind") == "budget":
        return (f"| {name} | {tfdag} | budget | | ≤ {case['target']:.3g} s | "
                f"{'yes' if case['met'] else 'no'} | {case.get('bound', '')} |")
    baseline = case.get("baseline_name") or "baseline"
    base = f"{baseline}: {_with_spread(case['baseline'], case.get('baseline_spread'))}{unit}"
    better = "" if case.get("higher_is_better", True) else " (lower is better)"
    if case.get("target") is None:  # a ratio reported, with no target
        return f"| {name} | {tfdag} | {base} | {case['ratio']:.2f}{better} | reported | | {case.get('bound', '')} |"
    return (f"| {name} | {tfdag} | {base} | {case['ratio']:.2f}{better} | ≥ {case['target']:.3g} | "
            f"{'yes' if case['met'] else 'no'} | {case.get('bound', '')} |")


def table(results: dict) -> str:
    """The markdown table of `results` (the parsed results.json), with a line naming the run it comes from."""
    machine = results.get("machine", {})
    load_start = ", ".join(f"{x:.1f}" for x in results.get("load_average_start", []))
    load_end = ", ".join(f"{x:.1f}" for x in results.get("load_average_end", []))
    quick = " **quick run (small sizes): not representative**" if results.get("quick") else ""
    lines = [
        (f"Run of {results.get('date', '?')} at commit `{results.get('commit', '?')[:12]}`"
        f"{' (with uncommitted changes)' if results.get('uncommitted_changes') else ''}: "
        f"{machine.get('usable_cores', '?')} cores ({machine.get('cpu_model') or 'unknown CPU'}), "
        f"{machine.get('memory_gb', '?')} GB; load average {load_start} at the start, {load_end} at the end."
        f"{quick} Medians of interleaved repetitions, min–max in brackets."),
        "",
        "| case | tfdag | baseline | ratio | target | met | what bounds it |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [_row(case) for case in results.get("cases", [])]
    return "\n".join(lines)


def write_readme(text: str, readme: Path = README) -> None:
    content = readme.read_text()
    if START not in content or END not in content:
        raise SystemExit(f"{readme} has no {START} ... {END} markers to put the table between")
    head, rest = content.split(START, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(f"{head}{START}\n{text}\n{END}{tail}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.table", description=__doc__)
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--write", action="store_true", help="write the table into docs/performance.md")
    args = parser.parse_args(argv)
    text = table(json.loads(args.results.read_text()))
    if args.write:
        write_readme(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
