"""A task's worker process: its environment, its streamed and prefixed output, its traceback tail, stopped or not."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import psutil

from pipeline_lib.cluster.info import ClusterInfo
from pipeline_lib.launch.processes import TaskProcess, TaskSpec, is_stopped, worker_env
from pipeline_lib.launch.spec import PARENT_PID_ENV
from tests.pipeline_lib.launch_support import REPO_ROOT


def test_worker_env_sets_tf_config_parent_pid_and_the_project_on_the_path(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", '{"stale": true}')
    cluster = ClusterInfo(task_type="worker", task_index=1, cluster={"worker": ("127.0.0.1:1", "127.0.0.1:2")})
    env = worker_env(TaskSpec(cluster, is_trainer=True), {"TFDAG_FAULT": "kill:worker=1:step=3"})
    assert json.loads(env["TF_CONFIG"])["task"] == {"type": "worker", "index": 1}
    assert env["TFDAG_FAULT"] == "kill:worker=1:step=3" and env[PARENT_PID_ENV] == str(os.getpid())
    assert env["PYTHONPATH"].split(os.pathsep)[0] == REPO_ROOT
    assert os.path.isdir(os.path.join(REPO_ROOT, "pipeline_lib"))
    single = worker_env(TaskSpec(ClusterInfo(), is_trainer=True, env_tf_config=False), {})
    assert "TF_CONFIG" not in single


def test_output_is_streamed_with_the_task_prefix_and_the_tail_starts_at_the_traceback():
    code = "print('step 1'); print('step 2'); raise ValueError('bad label')"
    popen = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             start_new_session=True)
    lines: list[str] = []
    process = TaskProcess(TaskSpec(ClusterInfo(), is_trainer=True), popen, lines.append, threading.Lock())
    process.reap()
    assert process.poll() == 1
    assert lines[:2] == ["[worker 0] step 1", "[worker 0] step 2"]
    tail = process.traceback_tail()
    assert tail.startswith("Traceback (most recent call last)") and tail.endswith("ValueError: bad label")


def test_is_stopped_sees_sigstop_and_kill_ends_the_group():
    popen = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], stdout=subprocess.PIPE,
                             start_new_session=True)
    process = TaskProcess(TaskSpec(ClusterInfo(), is_trainer=True), popen, lambda line: None, threading.Lock())
    try:
        assert not is_stopped(popen.pid)
        os.kill(popen.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 30
        while psutil.Process(popen.pid).status() != psutil.STATUS_STOPPED and time.monotonic() < deadline:
            time.sleep(0.05)
        assert is_stopped(popen.pid)
    finally:
        process.kill()
        process.reap()
    assert popen.returncode == -signal.SIGKILL
    assert not is_stopped(popen.pid)  # gone: unreadable, not stopped
