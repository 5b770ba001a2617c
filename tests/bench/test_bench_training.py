"""Tests for bench.bench_training's timing window: steady state only, execution ends only (no times asserted)."""

from __future__ import annotations

import pytest

from bench.bench_training import execution_ends, steady_rate


def test_execution_ends_follow_the_loops_chunking():
    # 10 steps per epoch, 4 per execution: executions end at 4, 8, 10 in each epoch, and at the last step.
    assert sorted(execution_ends(25, 10, 4)) == [4, 8, 10, 14, 18, 20, 24, 25]
    assert sorted(execution_ends(6, 3, 1)) == [1, 2, 3, 4, 5, 6]


def test_steady_rate_counts_only_steps_inside_the_window():
    # Step 4's execution took 100 s (tracing); then 4 steps per 2 s wall and 1 s CPU, batch 8.
    times = {4: (100.0, 50.0), 8: (102.0, 51.0), 12: (104.0, 52.0)}
    rate, cpu_us = steady_rate(times, warmup_steps=3, examples_per_step=8)
    assert rate == pytest.approx(8 * 8 / 4.0)
    assert cpu_us == pytest.approx(2.0 / 64 * 1e6)


def test_steady_rate_needs_steps_after_the_warm_up():
    with pytest.raises(ValueError, match="warm-up step 20"):
        steady_rate({4: (0.0, 0.0), 8: (1.0, 1.0)}, warmup_steps=20, examples_per_step=8)
