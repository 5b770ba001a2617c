"""`train.isolation: none`: the single worker trains on a thread of this process, under the same supervisor."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

from pipeline_lib.checkpoints import manifests as checkpoints
from pipeline_lib.config import ConfigError, Isolation
from pipeline_lib.launch.errors import WorkerFailed, WorkerInputError
from pipeline_lib.launch.in_process import InProcessGroup, ThreadTask
from pipeline_lib.launch.launchers import LaunchOptions, launch_training
from pipeline_lib.launch.spec import PREEMPTION_EXIT_CODE, RESULT_NAME
from tests.pipeline_lib.launch_support import (
    LogCapture,
    assert_no_orphans,
    make_config,
    make_spec,
    plan_for,
)


def test_isolation_none_is_refused_for_anything_but_one_local_worker(tmp_path):
    assert make_config(str(tmp_path)).train.isolation == Isolation.PROCESS  # the default: supervised processes
    for train in ({"workers": 2}, {"strategy": "parameter_server", "parameter_servers": 1}):
        with pytest.raises(ConfigError, match=r"train.isolation 'none' trains one worker .* set train.isolation: "
                                              r"process \(the default\) for a cluster"):
            make_config(str(tmp_path), isolation="none", **train)


def test_one_worker_trains_in_this_process_with_progress_and_result(tmp_path, dataset):
    config = make_config(str(tmp_path), isolation="none", checkpoint_every_steps=20)
    run_dir = str(tmp_path / "run")
    plan = plan_for(dataset, config, steps=60)
    progress, logs = [], LogCapture()
    result = launch_training(config, dataset, plan, run_dir,
                             options=LaunchOptions(log_fn=logs, on_progress=progress.append))
    assert result.final_step == 60 and result.num_restarts == 0
    with open(os.path.join(run_dir, RESULT_NAME)) as handle:
        assert json.load(handle)["final_step"] == 60
    assert checkpoints.latest_valid(os.path.join(run_dir, "checkpoints")).step == 60
    # No worker process: the heartbeat the supervisor followed was written by this process.
    assert_no_orphans(timeout_s=0.1)
    assert progress and all(p.total_steps == 60 for p in progress)  # the supervisor followed its heartbeat
    assert not [t.name for t in threading.enumerate() if t.name.startswith("tfdag-train-")]


def test_a_stop_request_checkpoints_and_exits_as_a_preemption_and_the_next_attempt_resumes(tmp_path, dataset):
    config = make_config(str(tmp_path), isolation="none", checkpoint_every_steps=1000)
    run_dir = str(tmp_path / "run")
    spec = make_spec(config, dataset, plan_for(dataset, config, steps=5000), run_dir)
    group = InProcessGroup(spec, config)
    (task,) = group.plan_attempt()
    logs = LogCapture()
    handle = group.start(task, logs, threading.Lock())
    deadline = time.monotonic() + 120
    while (handle.read_heartbeat() or {}).get("step", 0) < 5 and time.monotonic() < deadline:
        assert handle.poll() is None, logs.text
        time.sleep(0.05)
    beat = handle.read_heartbeat()
    assert beat["pid"] == os.getpid() and beat["step"] >= 5
    # An attempt cannot start beside a running thread.
    with pytest.raises(WorkerFailed, match=r"trains in this process \(train.isolation: none\) and did not stop "
                                           r"within .* set train.isolation: process"):
        group.plan_attempt()
    handle.kill()
    handle.reap()
    assert handle.poll() == PREEMPTION_EXIT_CODE
    stopped_at = checkpoints.latest_valid(os.path.join(run_dir, "checkpoints")).step
    assert 5 <= stopped_at < 5000  # the stop's own checkpoint, not a periodic one
    group.plan_attempt()  # the thread has ended: the next attempt may start


def test_a_failure_in_the_thread_is_a_permanent_worker_failure_with_its_traceback(tmp_path, dataset):
    config = make_config(str(tmp_path), isolation="none", max_restarts=3,
                         model={"factory": "mlp", "params": {"hidden_units": [-1]}})
    logs = LogCapture()
    with pytest.raises(WorkerFailed) as failure:
        launch_training(config, dataset, plan_for(dataset, config, steps=10), str(tmp_path / "run"),
                        options=LaunchOptions(log_fn=logs))
    assert "a permanent failure, not restarted (attempt 1)" in str(failure.value)
    assert failure.value.tail.startswith("Traceback (most recent call last)") and failure.value.exit_code == 1
    assert "[worker 0] Traceback (most recent call last)" in logs.text


def test_bad_input_in_the_thread_is_one_line_naming_it(tmp_path, dataset):
    import tensorflow as tf

    tf.constant(1.0) + 1.0  # TensorFlow is running in this process: its CPU can no longer be split
    config = make_config(str(tmp_path), isolation="none", cpu_replicas=3)
    with pytest.raises(WorkerInputError, match=r"^worker 0: train.cpu_replicas \(3\) needs 3 logical CPU devices "
                                               r".* set train.isolation: process") as failure:
        launch_training(config, dataset, plan_for(dataset, config, steps=10), str(tmp_path / "run"),
                        options=LaunchOptions(log_fn=LogCapture()))
    assert "Traceback" not in str(failure.value)


def test_a_thread_task_reports_its_exit_like_a_process(tmp_path, dataset):
    config = make_config(str(tmp_path), isolation="none")
    spec = make_spec(config, dataset, plan_for(dataset, config, steps=10), str(tmp_path / "run"))
    group = InProcessGroup(spec, config)
    (task,) = group.plan_attempt()
    handle = group.start(task, LogCapture(), threading.Lock())
    assert isinstance(handle, ThreadTask)
    handle.reap(timeout_s=120)
    assert handle.poll() == 0 and not handle.is_stopped() and handle.read_heartbeat()["step"] == 10
