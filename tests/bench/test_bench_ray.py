"""Tests for bench.bench_ray's rate window: steady state only (no times asserted)."""

from __future__ import annotations

import pytest

from bench.bench_ray import PROGRESS, steady_rate


def test_steady_rate_starts_after_the_warm_up():
    points = [(0.0, 50), (100.0, 100), (102.0, 150), (104.0, 200)]
    assert steady_rate(points, warmup_steps=100) == pytest.approx(100 / 4.0)
    with pytest.raises(ValueError, match="warm-up step 300"):
        steady_rate(points, warmup_steps=300)


def test_the_chief_progress_line_is_read_from_both_launchers_prefixes():
    line = "train | step:    150 | steps/sec: 41.3 | examples/sec: 2643 | loss: 0.1834"
    assert PROGRESS.search(f"[worker 0] INFO pipeline_lib.training.progress: {line}").group(1) == "150"
    assert PROGRESS.search(f"[worker 0 @ 127.0.0.2] INFO x: {line}").group(1) == "150"
    assert PROGRESS.search(f"[worker 1 @ 127.0.0.2] INFO x: {line}") is None
