"""Session-scoped real servers shared by every test that needs them: one `tfdag stack up` (Prefect server, MLflow
server, work pool, process worker, deployments) on free loopback ports, started once per test run and shared by
its xdist processes."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from filelock import FileLock

from flows import stack

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class RunningStack:
    state: stack.StackState
    root: Path
    user_home: Path  # PREFECT_HOME of the "user's shell": its profile points at the stack

    def cli_env(self, *, api_url: bool = True) -> dict[str, str]:
        """The environment of a CLI the test runs, as a user's shell after `tfdag stack up`."""
        env = dict(os.environ)
        env["PREFECT_HOME"] = str(self.user_home)
        env.pop("PREFECT_PROFILES_PATH", None)
        env.pop("MLFLOW_TRACKING_URI", None)
        if api_url:
            env["PREFECT_API_URL"] = self.state.prefect_api_url
        else:
            env.pop("PREFECT_API_URL", None)
        return env


def prefect_cli(running: RunningStack, *args: str, api_url: bool = True, timeout: float = 900):
    return subprocess.run([stack.console_script("prefect"), *args], cwd=ROOT, env=running.cli_env(api_url=api_url),
                          capture_output=True, text=True, timeout=timeout, check=False)


def _stack_cli(action: str, root: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.cli", "stack", action, "--root", str(root)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=900, check=False)


@pytest.fixture(scope="session")
def tfdag_stack(tmp_path_factory, worker_id) -> Iterator[RunningStack]:
    """`tfdag stack up` through the CLI, on free ports, with a throw-away user PREFECT_HOME; `down` at the end.

    One stack for the whole run: under pytest-xdist the test processes share it (a file lock and a count of the
    processes using it, in the run's common temporary folder); the last one out stops it."""
    shared = tmp_path_factory.getbasetemp() if worker_id == "master" else tmp_path_factory.getbasetemp().parent
    base = shared / "shared-stack"
    base.mkdir(exist_ok=True)
    root, user_home = base / "stack" / ".tfdag", base / "user-prefect-home"
    user_home.mkdir(exist_ok=True)
    env = dict(os.environ, TFDAG_PREFECT_PORT="0", TFDAG_MLFLOW_PORT="0", PREFECT_HOME=str(user_home))
    for name in ("PREFECT_API_URL", "PREFECT_PROFILES_PATH", "MLFLOW_TRACKING_URI"):
        env.pop(name, None)
    users = base / "users"
    with FileLock(str(base / "lock")):
        count = int(users.read_text()) if users.exists() else 0
        if count == 0:
            up = _stack_cli("up", root, env)
            if up.returncode != 0:
                _stack_cli("down", root, env)
                pytest.fail(f"tfdag stack up failed ({up.returncode}):\n{up.stdout[-4000:]}\n{up.stderr[-4000:]}")
        state = stack.read_state(root)
        assert state is not None, "tfdag stack up recorded no state"
        running = RunningStack(state=state, root=root, user_home=user_home)
        if count == 0:
            _pause_schedules(running)
        users.write_text(str(count + 1))
    yield running
    with FileLock(str(base / "lock")):
        count = int(users.read_text()) - 1
        users.write_text(str(count))
        if count == 0:
            down = _stack_cli("down", root, env)
            leftovers = [r.name for r in state.services if stack.find_process(r) is not None]
            assert down.returncode == 0 and not leftovers, (
                f"tfdag stack down left {leftovers}:\n{down.stdout}{down.stderr}")


# The deployments of prefect.yaml with a schedule: the nightly retrain (03:00 UTC), the scoring after it (04:00) and
# the weekly study (Sundays 05:00).
SCHEDULED_DEPLOYMENTS = ("retrain/nightly", "batch-predict/champion", "tune-pipeline/weekly")


def _pause_schedules(running: RunningStack) -> None:
    """The crons must not start a real retrain or scoring run in the middle of a test session that spans 03:00 or
    04:00 UTC. What `prefect deployment schedule pause` does, through the client (no CLI process per schedule)."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with (temporary_settings(updates={PREFECT_API_URL: running.state.prefect_api_url}),
          get_client(sync_client=True) as client):
        for name in SCHEDULED_DEPLOYMENTS:
            deployment = client.read_deployment_by_name(name)
            assert deployment.schedules, f"{name} has no schedule to pause"
            for schedule in deployment.schedules:
                client.update_deployment_schedule(deployment.id, schedule.id, active=False)


@pytest.fixture(scope="session")
def prefect_api(tfdag_stack):
    """The session's Prefect server for in-process flows (and subprocesses through PREFECT_API_URL)."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    url = tfdag_stack.state.prefect_api_url
    previous = os.environ.get("PREFECT_API_URL")
    os.environ["PREFECT_API_URL"] = url
    try:
        with temporary_settings(updates={PREFECT_API_URL: url}):
            yield url
    finally:
        if previous is None:
            os.environ.pop("PREFECT_API_URL", None)
        else:
            os.environ["PREFECT_API_URL"] = previous


@pytest.fixture(scope="session")
def mlflow_client(tfdag_stack):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=tfdag_stack.state.mlflow_url, registry_uri=tfdag_stack.state.mlflow_url)
