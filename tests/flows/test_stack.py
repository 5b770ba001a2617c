"""The local stack's process bookkeeping: ports, pid + start-time records, stopping exactly what was started."""

from __future__ import annotations

import io
import socket
import sys
import time

import psutil
import pytest

from flows import stack
from pipeline_lib.core import net

SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]
# A parent that starts a child and waits: `down` must take the child along.
PARENT = [sys.executable, "-c",
          ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
           "time.sleep(120)")]


def _start(tmp_path, command=SLEEPER, name="sleeper") -> stack.ServiceRecord:
    return stack.start_process(name, command, tmp_path / "logs" / f"{name}.log", env={"PATH": "/usr/bin:/bin"})


def test_choose_port_prefers_the_default_and_refuses_a_taken_configured_port():
    with socket.socket() as busy:
        busy.bind((stack.HOST, 0))
        busy.listen()
        taken = busy.getsockname()[1]
        assert stack.choose_port(None, taken, "Prefect server") != taken
        with pytest.raises(stack.StackError, match=rf"Prefect server port {taken} on 127.0.0.1 is in use"):
            stack.choose_port(taken, 4200, "Prefect server")
    free = net.free_port()
    assert stack.choose_port(free, 4200, "MLflow server") == free
    assert stack.choose_port(0, 4200, "MLflow server") > 0


def test_a_port_variable_that_is_not_a_number_is_named(monkeypatch):
    monkeypatch.setenv("TFDAG_PREFECT_PORT", "http")
    with pytest.raises(stack.StackError, match=r"TFDAG_PREFECT_PORT \('http'\) must be a port number"):
        stack.env_port("TFDAG_PREFECT_PORT")


def test_stop_process_stops_the_recorded_process_and_its_children(tmp_path):
    record = _start(tmp_path, PARENT, "parent")
    process = stack.find_process(record)
    assert process is not None
    deadline = time.monotonic() + 30
    while not process.children() and time.monotonic() < deadline:
        time.sleep(0.1)
    children = process.children()
    assert children
    assert stack.stop_process(record, timeout_s=10) == f"parent (pid {record.pid}) stopped"
    assert stack.find_process(record) is None
    assert not any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children)
    assert stack.stop_process(record) == f"parent (pid {record.pid}) was not running"


def test_a_start_time_read_a_second_apart_is_the_same_process(tmp_path):
    """/proc/stat's btime moves by a whole second when a VM's clock is stepped: `up` once saw a healthy-to-be
    MLflow server as "exited" because its start time, read twice, differed by that second."""
    record = _start(tmp_path)
    try:
        for shift in (-1.0, 1.0):
            assert stack.find_process(record.model_copy(update={"create_time": record.create_time + shift}))
    finally:
        stack.stop_process(record)


def test_a_record_whose_start_time_differs_is_never_stopped(tmp_path):
    """A pid reused by another process after the stack died must not be killed by `down`."""
    record = _start(tmp_path)
    try:
        impostor = record.model_copy(update={"create_time": record.create_time - 3600})
        assert stack.find_process(impostor) is None
        assert "was not running" in stack.stop_process(impostor)
        assert stack.find_process(record) is not None
    finally:
        stack.stop_process(record)


def test_down_stops_the_recorded_services_worker_first_and_forgets_the_state(tmp_path):
    root = tmp_path / ".tfdag"
    records = tuple(_start(tmp_path, name=name) for name in ("mlflow-server", "prefect-server", "worker"))
    state = stack.StackState(root=str(root), project_dir=str(tmp_path), prefect_ui_url="http://127.0.0.1:1",
                             prefect_api_url="http://127.0.0.1:1/api", mlflow_url="http://127.0.0.1:2",
                             work_pool=stack.WORK_POOL, services=records)
    stack.write_state(root, state)
    assert stack.read_state(root) == state

    out = io.StringIO()
    assert stack.stack_command("status", root=root, out=out) == 0
    assert all(f"pid {r.pid}" in out.getvalue() for r in records)

    lines = stack.stack_down(root)
    assert [line.split()[0] for line in lines] == ["worker", "mlflow-server", "prefect-server"]  # reverse start order
    assert all(stack.find_process(r) is None for r in records)
    assert stack.read_state(root) is None
    out = io.StringIO()
    assert stack.stack_command("status", root=root, out=out) == 1
    assert "no stack recorded" in out.getvalue()


def test_status_reports_a_dead_service(tmp_path):
    root = tmp_path / ".tfdag"
    record = _start(tmp_path, name="worker")
    stack.stop_process(record)
    state = stack.StackState(root=str(root), project_dir=str(tmp_path), prefect_ui_url="u", prefect_api_url="u/api",
                             mlflow_url="m", work_pool=stack.WORK_POOL, services=(record,))
    stack.write_state(root, state)
    out = io.StringIO()
    assert stack.stack_command("status", root=root, out=out) == 1
    assert "not running" in out.getvalue()


def test_wait_until_fails_early_with_the_log_tail_when_the_process_exits(tmp_path):
    record = _start(tmp_path, [sys.executable, "-c", "print('port already in use'); raise SystemExit(3)"], "server")
    with pytest.raises(stack.StackError, match=r"(?s)server exited before a healthy API.*port already in use"):
        stack.wait_until(lambda: False, record, "a healthy API", timeout_s=60)
