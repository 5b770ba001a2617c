"""Tests for pipeline_lib.testing.stage_stop: a run stopped as a named stage starts, through the stage events."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

from pipeline_lib.core import events
from pipeline_lib.testing.stage_stop import StageStopped, stop_at_stage
from tests.pipeline_lib.launch_support import REPO_ROOT


def test_the_named_stage_raises_through_emit_and_the_others_pass():
    with stop_at_stage("train") as started:
        events.emit(events.StageStarted("convert_to_tfrecords"))
        events.emit(events.StageFinished("convert_to_tfrecords", 1.0))
        with pytest.raises(StageStopped, match="'train'") as stopped:
            events.emit(events.StageStarted("train"))
    assert stopped.value.stage == "train" and started == ["convert_to_tfrecords", "train"]
    assert isinstance(stopped.value, KeyboardInterrupt)  # what a flow's lifecycle ends as KILLED
    events.emit(events.StageStarted("train"))  # the block is over: nothing listens


def test_a_signal_stops_the_process_at_the_stage():
    code = textwrap.dedent("""
        import signal
        from pipeline_lib.core import events
        from pipeline_lib.testing.stage_stop import stop_at_stage
        with stop_at_stage("evaluate", signum=signal.SIGKILL):
            events.emit(events.StageStarted("train"))
            print("trained", flush=True)
            events.emit(events.StageStarted("evaluate"))
            print("evaluated", flush=True)
    """)
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert "trained" in done.stdout and "evaluated" not in done.stdout
