"""The watchdog's view of a heartbeat: progress when the step or the phase changes, one bound per phase."""

from __future__ import annotations

import json

from pipeline_lib.launch.supervisor import (
    SLOW_PHASE_FACTOR,
    STARTUP_ALLOWANCE_S,
    HeartbeatWatch,
    describe_bound,
    phase_bound_s,
)
from pipeline_lib.training.hooks import Phase


def test_the_watch_counts_silence_from_the_last_step_that_advanced(tmp_path):
    path = tmp_path / "worker-0.json"
    watch = HeartbeatWatch(str(path), started=100.0)
    watch.update(now=105.0)  # no file yet: still silent since the start
    assert not watch.has_beaten and watch.silent_for(110.0) == 10.0
    path.write_text(json.dumps({"step": 3}))
    watch.update(now=111.0)
    assert watch.has_beaten and watch.last_step == 3 and watch.silent_for(115.0) == 4.0
    watch.update(now=120.0)  # the same step again is no progress
    assert watch.last_step == 3 and watch.silent_for(120.0) == 9.0
    path.write_text("{half a file")
    watch.update(now=121.0)
    assert watch.last_step == 3 and watch.last_progress == 111.0


def test_a_new_phase_is_progress_and_sets_the_bound(tmp_path):
    path = tmp_path / "worker-0.json"
    watch = HeartbeatWatch(str(path), started=0.0)
    assert watch.phase == Phase.STARTING and watch.overdue_s(10.0, 5.0) == 10.0 - 5.0 - STARTUP_ALLOWANCE_S
    path.write_text(json.dumps({"step": 20, "phase": "starting", "start_step": 20}))
    watch.update(now=1.0)
    assert watch.start_step == 20 and watch.phase == Phase.STARTING
    path.write_text(json.dumps({"step": 30, "phase": "stepping", "start_step": 20}))
    watch.update(now=2.0)
    assert watch.overdue_s(7.5, 5.0) == 0.5  # stepping: hang_timeout_s
    path.write_text(json.dumps({"step": 30, "phase": "finishing", "start_step": 20}))  # same step, new phase
    watch.update(now=3.0)
    assert watch.phase == Phase.FINISHING and watch.last_progress == 3.0
    assert watch.overdue_s(3.0 + 14.0, 5.0) < 0 < watch.overdue_s(3.0 + 16.0, 5.0)  # finishing: 3 × 5 s


def test_the_phase_bounds_derive_from_hang_timeout_s():
    assert phase_bound_s(Phase.STEPPING, 20.0) == 20.0
    assert phase_bound_s(Phase.STARTING, 20.0) == 20.0 + STARTUP_ALLOWANCE_S
    assert phase_bound_s(Phase.SAVING, 20.0) == phase_bound_s(Phase.FINISHING, 20.0) == SLOW_PHASE_FACTOR * 20.0
    assert describe_bound(Phase.FINISHING, 20.0) == "60 s = 3 × train.hang_timeout_s 20 s"
    assert describe_bound(Phase.STEPPING, 20.0) == "train.hang_timeout_s 20 s"
