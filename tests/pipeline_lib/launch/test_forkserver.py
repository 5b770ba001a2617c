"""The fork server the local launcher starts its workers from: a real server process, real forks and signals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import psutil
import pytest

from pipeline_lib.launch import forkserver
from pipeline_lib.launch.processes import ONE_PROCESS, warm_fork_server, worker_env
from pipeline_lib.training import prefork
from tests.pipeline_lib.launch_support import REPO_ROOT

PROBE = "tests.pipeline_lib.launch.fork_probe"


@pytest.fixture(scope="module")
def server():
    # The server a one-process launch from this process forks from, shared by the launches of this process.
    server = warm_fork_server({})
    assert server is not None
    return server


def _spawn(server, tmp_path, *args: str, **env: str) -> forkserver.ForkedProcess:
    return server.spawn(PROBE, ["--spec", str(tmp_path / "spec.json"), *args], {**os.environ, **env}, str(tmp_path))


def test_a_forked_child_gets_the_launch_environment_directory_session_and_exit_code(server, tmp_path):
    tf_config = json.dumps({"cluster": {"worker": ["127.0.0.1:1"]}, "task": {"type": "worker", "index": 0}})
    child = _spawn(server, tmp_path, "7", PROBE="a value", TF_CONFIG=tf_config)
    lines = child.stdout.read().decode().splitlines()
    assert child.wait(timeout=30) == 7
    told = json.loads(lines[0])
    assert told == {"cwd": str(tmp_path), "probe": "a value", "tf_config": tf_config,
                    "argv": [PROBE, "--spec", str(tmp_path / "spec.json"), "7"], "own_session": True, "stdin": "",
                    "tensorflow_imported": True}
    assert lines[1:] == ["on stderr"]


def test_a_child_that_raises_exits_1_with_its_traceback(server, tmp_path):
    child = _spawn(server, tmp_path, "raise")
    out = child.stdout.read().decode()
    assert child.wait(timeout=30) == 1
    assert "Traceback (most recent call last)" in out and "ValueError: the probe was told to fail" in out


def test_a_killed_child_reports_the_signal_like_popen_and_shows_its_command_in_ps(server, tmp_path):
    child = _spawn(server, tmp_path, "sleep")
    assert child.stdout.readline()  # it runs
    assert f"-m {PROBE} --spec" in " ".join(psutil.Process(child.pid).cmdline())
    assert child.poll() is None
    os.killpg(child.pid, signal.SIGKILL)  # its own process group, as the launcher's kill
    assert child.wait(timeout=30) == -signal.SIGKILL
    assert child.poll() == -signal.SIGKILL


def test_preparing_for_fork_starts_no_thread_and_creates_no_tensorflow_context_and_the_server_did_it(server):
    # A fresh process (this one has TensorFlow running): the server's imports, then what it prepares before forking.
    script = textwrap.dedent("""
        import json, os, threading
        from pipeline_lib.core.quiet import import_tensorflow
        import_tensorflow()
        import pipeline_lib.launch.worker
        from pipeline_lib.training import prefork
        from tensorflow.python.eager import context
        before = len(os.listdir("/proc/self/task"))
        prefork.prepare()
        print(json.dumps({"before": before, "after": len(os.listdir("/proc/self/task")),
                          "python_threads": threading.active_count(), "eager_context": context._context is not None}))
    """)
    # The server's environment (the threads a library starts at import can depend on it).
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, check=True,
                          env=worker_env(ONE_PROCESS, {}))
    told = json.loads(done.stdout.splitlines()[-1])
    # Threads the imports started natively (jemalloc's among them, some of them short-lived) are there before;
    # preparing adds none, and the server has no more than a process that only imported and prepared.
    assert told["after"] <= told["before"] and told["python_threads"] == 1 and not told["eager_context"], told
    assert psutil.Process(server.pid).num_threads() <= told["after"]


def test_a_child_inherits_the_prepared_conversions_and_its_training_converts_nothing(server, tmp_path):
    child = _spawn(server, tmp_path, "train")
    out = child.stdout.read().decode()
    assert child.wait(timeout=120) == 0, out
    told = json.loads(out.splitlines()[-1])
    assert told["eager_context"] is False
    assert told["cached"] == [qualname for _, qualname, _ in prefork.CONVERTED]
    assert told["final_step"] == 4 and told["evaluated"]
    assert told["converted"] == [], f"add them to pipeline_lib.training.prefork.CONVERTED: {told['converted']}"


def test_a_function_missing_from_its_module_names_the_table_to_update():
    with pytest.raises(LookupError, match=r"pipeline_lib.training.step defines no function 'create_train_step"
                                          r".<locals>.gone', listed in pipeline_lib.training.prefork.CONVERTED"):
        prefork.find_code("pipeline_lib.training.step", "create_train_step.<locals>.gone")


def test_the_server_is_keyed_by_what_is_fixed_at_import_time():
    base = {"PATH": "/bin", "PYTHONPATH": "/x", "TF_CPP_MIN_LOG_LEVEL": "3"}
    assert forkserver.server_key(base) == forkserver.server_key(
        {**base, "TF_CONFIG": "{}", "TFDAG_FAULT": "kill", "TFDAG_SECRET_TOKEN": "s", "HOME": "/other"})
    for changed in ({"TF_NUM_INTRAOP_THREADS": "1"}, {"CUDA_VISIBLE_DEVICES": ""}, {"PYTHONPATH": "/y"},
                    {"TFDAG_VERBOSE": "1"}, {"OMP_NUM_THREADS": "1"}):
        assert forkserver.server_key({**base, **changed}) != forkserver.server_key(base), changed


def test_the_server_and_its_children_die_with_the_launcher_process(tmp_path):
    script = textwrap.dedent(f"""
        import os, sys, time
        from pipeline_lib.launch import forkserver
        server = forkserver.server_for(dict(os.environ, PYTHONUNBUFFERED="1"))
        child = server.spawn({PROBE!r}, ["sleep"], dict(os.environ), os.getcwd())
        child.stdout.readline()
        print(server.pid, child.pid, flush=True)
        time.sleep(300)
    """)
    launcher = subprocess.Popen([sys.executable, "-c", script], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONPATH": REPO_ROOT})
    try:
        server_pid, child_pid = map(int, launcher.stdout.readline().split())
        left = [psutil.Process(server_pid), psutil.Process(child_pid)]
        assert all(p.is_running() for p in left)
    finally:
        launcher.kill()  # SIGKILL: no finally block of the launcher runs
        launcher.wait()
    _, alive = psutil.wait_procs(left, timeout=15)
    assert alive == [], f"left behind: {[(p.pid, p.cmdline()) for p in alive]}"
