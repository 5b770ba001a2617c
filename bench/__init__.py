"""Benchmarks for `make bench`: each case measured against its baseline in the same run, interleaved.

A case records the median and the spread (min-max) of both sides over the repetitions; the ratio is of the
medians. `not_run` records a case that could not run and why; `budget` a time that must stay under a limit.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence


def _spread(samples: Sequence[float]) -> list[float]:
    return [float(min(samples)), float(max(samples))]


def case(name: str, value: float | Sequence[float], baseline: float | Sequence[float], target: float | None, *,
         higher_is_better: bool = True, unit: str = "", baseline_name: str = "", bound: str = "") -> dict:
    """One comparison of tfdag (`value`) with `baseline_name` (`baseline`): single numbers or the samples of
    interleaved repetitions. The ratio is value/baseline of the medians (baseline/value when lower is better),
    so ratio ≥ target always means the target is met; a `target` of None makes the ratio a reported figure
    (`met` None), for a baseline that moves too much from run to run to hold a target against.
    `bound` is one sentence on what limits the case.
    """
    values = [float(v) for v in value] if isinstance(value, Sequence) else [float(value)]
    baselines = [float(b) for b in baseline] if isinstance(baseline, Sequence) else [float(baseline)]
    median, base = statistics.median(values), statistics.median(baselines)
    ratio = median / base if higher_is_better else base / median
    return {"name": name, "status": "run", "kind": "ratio", "unit": unit, "value": median,
            "value_spread": _spread(values), "baseline": base, "baseline_spread": _spread(baselines),
            "baseline_name": baseline_name, "repetitions": min(len(values), len(baselines)),
            "ratio": float(ratio), "target": None if target is None else float(target),
            "met": None if target is None else bool(ratio >= target),
            "higher_is_better": higher_is_better, "bound": bound}


def budget(name: str, seconds: float | Sequence[float], limit_s: float, *, bound: str = "") -> dict:
    """A time that must stay under `limit_s` (no baseline): met when the median is at most the limit."""
    samples = [float(s) for s in seconds] if isinstance(seconds, Sequence) else [float(seconds)]
    median = statistics.median(samples)
    return {"name": name, "status": "run", "kind": "budget", "unit": "s", "value": median,
            "value_spread": _spread(samples), "repetitions": len(samples), "target": float(limit_s),
            "met": bool(median <= limit_s), "bound": bound}


def report(name: str, samples: Sequence[float], *, unit: str = "", bound: str = "") -> dict:
    """A measurement the issue asks to report, with no target or baseline (e.g. seconds lost per resize)."""
    values = [float(s) for s in samples]
    return {"name": name, "status": "run", "kind": "report", "unit": unit, "value": statistics.median(values),
            "value_spread": _spread(values), "repetitions": len(values), "bound": bound}


def not_run(name: str, reason: str) -> dict:
    """A case that could not run here, and why."""
    return {"name": name, "status": "not run", "reason": reason}


def interleaved(steps: Mapping[str, Callable[[], float]], repeats: int,
                before: Callable[[], None] | None = None) -> dict[str, list[float]]:
    """Run every step once per round, in turn (A B A B ...), `repeats` rounds; each step returns its measurement.

    Load from other processes then hits every side alike. `before` runs ahead of each step (e.g. `os.sync()`).
    """
    samples: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            if before is not None:
                before()
            samples[name].append(float(step()))
    return samples


def seconds_of(fn: Callable[[], object]) -> Callable[[], float]:
    """A step for `interleaved` that times `fn` (wall seconds)."""
    def timed() -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    return timed
