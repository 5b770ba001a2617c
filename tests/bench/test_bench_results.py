"""bench/__init__.py's records, bench/__main__.py's one-run results.json and bench/table.py's README table."""

from __future__ import annotations

import json
import sys
import types

import pytest

import bench
from bench import __main__ as bench_main
from bench import table


def test_case_records_medians_spreads_and_the_ratio_of_the_medians():
    record = bench.case("c", [1.0, 3.0, 2.0, 10.0, 2.5], [1.0, 1.0, 2.0, 1.0, 1.0], 2.0, unit="MB/s",
                        baseline_name="b", bound="why")
    assert (record["value"], record["value_spread"], record["baseline"]) == (2.5, [1.0, 10.0], 1.0)
    assert (record["ratio"], record["met"], record["repetitions"]) == (2.5, True, 5)
    lower = bench.case("rss", 200.0, 150.0, 0.67, higher_is_better=False)
    assert lower["ratio"] == pytest.approx(0.75) and lower["met"]
    reported = bench.case("disk", [1.0, 2.0], [4.0, 4.0], None, unit="MB/s", baseline_name="O_DIRECT")
    assert (reported["ratio"], reported["target"], reported["met"]) == (0.375, None, None)
    assert "| 0.38 | reported | |" in table._row(reported)


def test_budget_and_not_run():
    assert bench.budget("plan", [0.2, 0.4, 3.0], 1.0)["met"]  # the median counts, not the worst
    assert not bench.budget("plan", [2.0], 1.0)["met"]
    assert bench.not_run("x", "no tf_keras") == {"name": "x", "status": "not run", "reason": "no tf_keras"}


def test_interleaved_runs_the_steps_in_turn():
    calls = []
    samples = bench.interleaved({"a": lambda: calls.append("a") or 1.0, "b": lambda: calls.append("b") or 2.0}, 3)
    assert calls == ["a", "b"] * 3 and samples == {"a": [1.0] * 3, "b": [2.0] * 3}


def _suite(name: str, run) -> str:
    module = types.ModuleType(f"bench_fake_{name}")
    module.run = run
    sys.modules[module.__name__] = module
    return module.__name__


def test_results_json_is_one_run_and_a_failed_suite_is_not_run(tmp_path, monkeypatch):
    def broken(**_):
        raise RuntimeError("no server")

    monkeypatch.setattr(bench_main, "RESULTS", tmp_path / "results.json")
    monkeypatch.setattr(bench_main, "SUITES", {
        "one": _suite("one", lambda **_: [bench.case("first", 2.0, 1.0, 1.0)]),
        "two": _suite("two", lambda **_: [bench.case("second", 1.0, 2.0, 1.0)]),
        "broken": _suite("broken", broken),
    })
    assert bench_main.main(["one", "--quick", "--in-process"]) == 0
    assert bench_main.main(["two", "broken", "--quick", "--in-process"]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert [c["name"] for c in results["cases"]] == ["second", "broken suite"]  # nothing of the first run
    assert results["cases"][1]["status"] == "not run" and "no server" in results["cases"][1]["reason"]
    assert results["quick"] and results["machine"]["usable_cores"] >= 1
    assert len(results["load_average_start"]) == len(results["load_average_end"]) == 3
    assert "commit" in results and results["date"]


def test_table_prints_every_kind_and_replaces_the_readme_between_its_markers(tmp_path):
    results = {"commit": "abc", "date": "2026-12-04", "quick": True, "machine": {"usable_cores": 2},
               "load_average_start": [1.0, 1.0, 1.0], "load_average_end": [2.0, 2.0, 2.0],
               "cases": [bench.case("conv", [1.0, 2.0, 3.0], [4.0, 4.0, 4.0], 0.5, unit="MB/s",
                                    baseline_name="O_DIRECT", bound="the CPU."),
                         bench.budget("plan", [0.5], 1.0, bound="a budget."),
                         bench.report("resize", [3.0, 5.0, 4.0], unit="s", bound="a report."),
                         bench.not_run("mwms", "tf_keras missing")]}
    text = table.table(results)
    assert "quick run" in text
    assert "| conv | 2 (1–3) MB/s | O_DIRECT: 4 MB/s | 0.50 | ≥ 0.5 | yes | the CPU. |" in text
    assert "| plan | 0.5 s | budget | | ≤ 1 s | yes | a budget. |" in text
    assert "| resize | 4 (3–5) s | reported | | | | a report. |" in text
    assert "| mwms | not run |" in text and "tf_keras missing" in text
    readme = tmp_path / "README.md"
    readme.write_text(f"before\n{table.START}\nold\n{table.END}\nafter\n")
    table.write_readme(text, readme)
    content = readme.read_text()
    assert content.startswith("before\n") and content.endswith("after\n") and "old" not in content
    assert text in content
