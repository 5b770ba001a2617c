"""The watchdog's view of a heartbeat: progress only when the step advances."""

from __future__ import annotations

import json

from pipeline_lib.launch.supervisor import HeartbeatWatch


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
