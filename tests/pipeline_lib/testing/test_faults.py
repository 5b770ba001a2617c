"""TFDAG_FAULT parsing, once-per-run markers, and the real signals each fault sends (in child processes)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from pipeline_lib.testing import faults
from pipeline_lib.testing.faults import (
    Fault,
    FaultInjected,
    FaultInjector,
    FaultSpecError,
    parse_faults,
)
from tests.pipeline_lib.launch_support import REPO_ROOT


def test_parse_every_documented_form():
    parsed = parse_faults("kill:worker=1:step=30, stop:worker=1:step=30,term:worker=0:step=20,"
                          "raise:worker=1:step=10,kill_during_save:worker=0,kill_during_save:worker=0:step=20")
    assert parsed == (
        Fault("kill", 1, 30), Fault("stop", 1, 30), Fault("term", 0, 20), Fault("raise", 1, 10),
        Fault("kill_during_save", 0, None), Fault("kill_during_save", 0, 20),
    )
    assert parse_faults("stop:worker=0:phase=finishing,sleep:worker=1:phase=saving:seconds=7") == (
        Fault("stop", 0, phase="finishing"), Fault("sleep", 1, phase="saving", seconds=7))
    assert parse_faults(None) == () and parse_faults("  ") == ()


@pytest.mark.parametrize("text, fragment", [
    ("explode:worker=1:step=3", "unknown action 'explode'"),
    ("kill:worker=one:step=3", "'worker=one' is not worker=N, step=S"),
    ("kill:step=3", "has no worker=N"),
    ("stop:worker=1", "needs either step=S or phase=P"),
    ("stop:worker=1:step=3:phase=saving", "needs either step=S or phase=P"),
    ("stop:worker=1:phase=resting", "'phase=resting' is not worker=N"),
    ("kill:worker=1:when=3", "'when=3' is not worker=N"),
])
def test_parse_errors_name_the_value_and_the_allowed_forms(text, fragment):
    with pytest.raises(FaultSpecError) as error:
        parse_faults(text)
    message = str(error.value)
    assert fragment in message and "TFDAG_FAULT" in message
    assert "kill:worker=N:step=S" in message and "kill_during_save:worker=N[:step=S]" in message


def test_injector_keeps_only_this_workers_faults():
    injector = FaultInjector(parse_faults("raise:worker=1:step=3,kill:worker=0:step=9"), 1, "/nonexistent")
    assert injector.faults == (Fault("raise", 1, 3),)
    assert not FaultInjector(parse_faults("raise:worker=1:step=3"), 0, "/nonexistent")
    assert faults.injector_from_env(0, "/x", environ={}) is None


def test_phase_faults_fire_when_the_phase_is_entered_once_per_run(tmp_path):
    injector = FaultInjector(parse_faults("sleep:worker=0:phase=finishing:seconds=1"), 0, str(tmp_path / "run"))
    injector.on_step_end(100)  # a phase fault ignores steps
    injector.on_phase("saving", 100)
    started = time.monotonic()
    injector.on_phase("finishing", 100)
    assert time.monotonic() - started >= 1.0
    assert (tmp_path / "run" / ".faults" / "sleep-worker0-finishing").exists()
    started = time.monotonic()
    injector.on_phase("finishing", 100)  # fired once per run
    assert time.monotonic() - started < 0.5


def test_raise_fires_at_its_step_once_per_run(tmp_path):
    run_dir = str(tmp_path / "run")
    injector = FaultInjector(parse_faults("raise:worker=0:step=5"), 0, run_dir)
    injector.on_step_end(4)  # not yet
    with pytest.raises(FaultInjected, match="raise:worker=0:step=5"):
        injector.on_step_end(6)  # ≥ step: fires even when step 5 itself was inside one execution
    assert (tmp_path / "run" / ".faults" / "raise-worker0").is_file()
    # The restarted attempt (a fresh injector over the same run dir) does not fire it again.
    FaultInjector(parse_faults("raise:worker=0:step=5"), 0, run_dir).on_step_end(7)


def _run_child(code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})}, check=False)


@pytest.mark.parametrize("action, expected", [("kill", -signal.SIGKILL), ("term", -signal.SIGTERM)])
def test_signal_faults_send_real_signals(tmp_path, action, expected):
    result = _run_child(f"""
        from pipeline_lib.testing.faults import FaultInjector, parse_faults
        injector = FaultInjector(parse_faults("{action}:worker=0:step=2"), 0, {str(tmp_path)!r})
        injector.on_step_end(1)
        print("before", flush=True)
        injector.on_step_end(2)
        print("survived", flush=True)
    """)
    assert result.returncode == expected, result.stderr
    assert "before" in result.stdout and "survived" not in result.stdout
    assert f"{action} fires in worker 0 after step 2" in result.stdout
    assert (tmp_path / ".faults" / f"{action}-worker0").is_file()


def test_stop_fault_stops_the_process(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        from pipeline_lib.testing.faults import FaultInjector, parse_faults
        FaultInjector(parse_faults("stop:worker=0:step=1"), 0, {str(tmp_path)!r}).on_step_end(1)
        print("resumed", flush=True)
    """)], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    try:
        proc = psutil.Process(child.pid)
        for _ in range(600):
            if proc.status() == psutil.STATUS_STOPPED:
                break
            time.sleep(0.05)
        assert proc.status() == psutil.STATUS_STOPPED
    finally:
        child.kill()
        child.wait()
    assert child.returncode == -signal.SIGKILL


def test_kill_during_save_kills_after_the_data_before_the_manifest(tmp_path):
    result = _run_child(f"""
        import os
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
        import tensorflow as tf
        from pipeline_lib.testing.faults import FaultInjector, parse_faults
        injector = FaultInjector(parse_faults("kill_during_save:worker=0"), 0, {str(tmp_path)!r})
        injector.install_save_hook()
        ckpt = tf.train.Checkpoint(v=tf.Variable([1.0, 2.0]))
        ckpt.write({str(tmp_path / 'ckpt-10')!r})
        print("first save done", flush=True)
        ckpt.write({str(tmp_path / 'ckpt-20')!r})
        print("second save returned", flush=True)
    """)
    assert result.returncode == -signal.SIGKILL, result.stderr
    assert "first save done" in result.stdout and "second save returned" not in result.stdout
    names = sorted(os.listdir(tmp_path))
    assert "ckpt-20.index" in names and any(n.startswith("ckpt-20.data") for n in names)
    assert (tmp_path / ".faults" / "kill_during_save-worker0").is_file()
