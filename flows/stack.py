"""The local stack behind `tfdag stack up|down|status`: Prefect and MLflow servers, a work pool, a worker, deployments."""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO

import psutil
from pydantic import BaseModel, ConfigDict

from flows.ray_stack import (
    RAY_HOST,
    RayClusterError,
    RayClusterRecord,
    start_ray_cluster,
    stop_ray_cluster,
)
from pipeline_lib.config import DEFAULT_ROOT
from pipeline_lib.core.net import free_port, is_port_free

logger = logging.getLogger(__name__)

HOST = "127.0.0.1"
WORK_POOL = "tfdag-local"
WORKER_NAME = "tfdag-local-worker"
PROFILE = "tfdag-local"
PREFERRED_PREFECT_PORT = 4200
PREFERRED_MLFLOW_PORT = 5000
STATE_NAME = "stack.json"
ENV_NAME = "env"
PREFECT_FILE = Path("deployments") / "prefect.yaml"
# Services stop in this order: nothing new starts while the servers are still up to record it.
STOP_ORDER = ("worker", "prefect-server", "mlflow-server")
PROJECT_DIR = Path(__file__).resolve().parents[1]
_START_TIME_SLACK_S = 0.05


class StackError(RuntimeError):
    """The local stack cannot start or stop; the message names what failed, where its log is and the fix."""


class ServiceRecord(BaseModel):
    """One process the stack started: enough to find exactly that process again."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    pid: int
    create_time: float  # psutil's process start time: a reused pid has another
    command: tuple[str, ...]
    log_path: str
    url: str | None = None


class StackState(BaseModel):
    """What `tfdag stack up` started, written to <root>/stack/stack.json."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    root: str
    project_dir: str
    prefect_ui_url: str
    prefect_api_url: str
    mlflow_url: str
    work_pool: str
    services: tuple[ServiceRecord, ...]
    deployments: tuple[str, ...] = ()
    ray: RayClusterRecord | None = None  # `up --ray N`: the local Ray cluster
    profile: str | None = None  # the Prefect profile `up` activated
    previous_profile: str | None = None  # the one `down` restores
    started_at: str = ""

    def service(self, name: str) -> ServiceRecord | None:
        return next((s for s in self.services if s.name == name), None)


class ServiceStatus(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    pid: int
    running: bool
    detail: str
    url: str | None = None


def stack_dir(root: str | os.PathLike[str]) -> Path:
    """<root>/stack: the state file, the logs and the servers' data."""
    return Path(root).expanduser().resolve() / "stack"


def state_path(root: str | os.PathLike[str]) -> Path:
    return stack_dir(root) / STATE_NAME


def read_state(root: str | os.PathLike[str]) -> StackState | None:
    """The recorded stack, or None when `up` never ran (or `down` finished)."""
    path = state_path(root)
    if not path.is_file():
        return None
    return StackState.model_validate_json(path.read_text())


def _write_state(root: str | os.PathLike[str], state: StackState) -> None:
    path = state_path(root)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(state.model_dump_json(indent=2))
    os.replace(tmp, path)


# --- ports --------------------------------------------------------------------------------------------------

def choose_port(configured: int | None, preferred: int, what: str) -> int:
    """The configured port (which must be free), else `preferred` when free, else any free port; 0 means any.

    Raises:
        StackError: when the configured port is taken.
    """
    if configured is None:
        return preferred if is_port_free(preferred) else free_port()
    if configured == 0:
        return free_port()
    if not is_port_free(configured):
        raise StackError(f"{what} port {configured} on {HOST} is in use; free it, or choose another port "
                         "(0 picks a free one)")
    return configured


def _env_port(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        port = int(value)
    except ValueError:
        raise StackError(f"{name} ({value!r}) must be a port number (0 picks a free one)") from None
    if not 0 <= port <= 65535:
        raise StackError(f"{name} ({port}) must be between 0 and 65535")
    return port


# --- processes ----------------------------------------------------------------------------------------------

def _bin(name: str) -> str:
    """The console script beside this interpreter (the project's virtualenv), else on PATH."""
    candidate = Path(sys.executable).parent / name
    if candidate.exists():
        return str(candidate)
    found = shutil.which(name)
    if not found:
        raise StackError(f"the {name!r} command is not installed beside {sys.executable} nor on PATH; "
                         "install tfdag's dependencies (make install)")
    return found


def start_process(name: str, command: Sequence[str], log_path: Path, *, env: Mapping[str, str],
                  cwd: str | os.PathLike[str] | None = None, url: str | None = None) -> ServiceRecord:
    """Start a long-running process in its own session (so `stop_process` can stop its children too).

    Returns:
        The record that identifies exactly this process later (pid and start time).
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        log.write(f"\n=== {_now()} {' '.join(command)}\n".encode())
        log.flush()
        process = subprocess.Popen(list(command), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   cwd=cwd, env=dict(env), start_new_session=True)
    create_time = psutil.Process(process.pid).create_time()
    logger.info("started %s (pid %d): %s; log %s", name, process.pid, " ".join(command), log_path)
    return ServiceRecord(name=name, pid=process.pid, create_time=create_time, command=tuple(command),
                         log_path=str(log_path), url=url)


def find_process(record: ServiceRecord) -> psutil.Process | None:
    """The live process of a record, or None when it exited or its pid now belongs to another process."""
    try:
        process = psutil.Process(record.pid)
        if abs(process.create_time() - record.create_time) > _START_TIME_SLACK_S:
            return None
        if process.status() == psutil.STATUS_ZOMBIE:
            return None
        return process
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def stop_process(record: ServiceRecord, timeout_s: float = 15.0) -> str:
    """Stop the recorded process and its children: SIGTERM, then SIGKILL after `timeout_s`.

    Only the process whose pid *and* start time match the record is touched, with the processes it started.

    Returns:
        What happened, for the `down` report.
    """
    process = find_process(record)
    if process is None:
        return f"{record.name} (pid {record.pid}) was not running"
    try:
        family = [process, *process.children(recursive=True)]
    except psutil.NoSuchProcess:
        return f"{record.name} (pid {record.pid}) exited"
    for member in family:
        with contextlib.suppress(psutil.NoSuchProcess):
            member.send_signal(signal.SIGTERM)
    _gone, alive = psutil.wait_procs(family, timeout=timeout_s)
    for member in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            member.kill()
    psutil.wait_procs(alive, timeout=5)
    # Reap our own child (when `up` ran in this process) so it leaves no zombie.
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(record.pid, os.WNOHANG)
    how = "killed" if alive else "stopped"
    return f"{record.name} (pid {record.pid}) {how}"


def _http_ok(url: str, expect: Callable[[bytes], bool] | None = None, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            body = response.read()
            return response.status == 200 and (expect is None or expect(body))
    except (urllib.error.URLError, OSError, ValueError):
        return False


def prefect_server_answers(api_url: str) -> bool:
    """Whether the Prefect API at `api_url` (ending in /api) answers its health check."""
    return _http_ok(f"{api_url}/health")


def _tail(path: str | os.PathLike[str], num_chars: int = 3000) -> str:
    with contextlib.suppress(OSError):
        return Path(path).read_text(errors="replace")[-num_chars:]
    return ""


def wait_until(check: Callable[[], bool], record: ServiceRecord, what: str, timeout_s: float) -> None:
    """Poll `check` until it holds; fail early when the process exits.

    Raises:
        StackError: naming the service, its log and the log's tail.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        if find_process(record) is None:
            raise StackError(f"{record.name} exited before {what}; see {record.log_path}:\n{_tail(record.log_path)}")
        time.sleep(0.5)
    raise StackError(f"{record.name} did not reach {what} within {timeout_s:.0f} s; see {record.log_path}:\n"
                     f"{_tail(record.log_path)}")


def _run(command: Sequence[str], *, env: Mapping[str, str], cwd: str | os.PathLike[str] | None, log_path: Path,
         timeout_s: float = 300.0, check: bool = True) -> subprocess.CompletedProcess:
    """Run one short command, appending its output to a log."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(list(command), env=dict(env), cwd=cwd, capture_output=True, text=True,
                            timeout=timeout_s, stdin=subprocess.DEVNULL, check=False)
    with open(log_path, "a") as log:
        log.write(f"\n=== {_now()} {' '.join(command)} (exit {result.returncode})\n{result.stdout}{result.stderr}")
    if check and result.returncode != 0:
        raise StackError(f"`{' '.join(command)}` failed with exit code {result.returncode}; see {log_path}:\n"
                         f"{(result.stdout + result.stderr)[-3000:]}")
    return result


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


# --- the services -------------------------------------------------------------------------------------------

def _base_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    # No telemetry from a local stack, and no network needed.
    env.update({"PREFECT_SERVER_ANALYTICS_ENABLED": "false", "MLFLOW_DISABLE_TELEMETRY": "true",
                "DO_NOT_TRACK": "1", "PYTHONUNBUFFERED": "1"})
    env.update(extra or {})
    return env


def prefect_env(directory: Path, api_url: str | None = None) -> dict[str, str]:
    """The environment of the stack's Prefect processes: their own PREFECT_HOME (database, results) under the stack."""
    env = _base_env({"PREFECT_HOME": str(directory / "prefect-home")})
    env.pop("PREFECT_PROFILES_PATH", None)
    if api_url:
        env["PREFECT_API_URL"] = api_url
    else:
        env.pop("PREFECT_API_URL", None)
    return env


def start_prefect_server(directory: Path, port: int, timeout_s: float = 120.0) -> ServiceRecord:
    """`prefect server start` on 127.0.0.1:port with a sqlite database under `directory`; waits for /api/health."""
    url = f"http://{HOST}:{port}"
    env = prefect_env(directory)
    env["PREFECT_SERVER_API_HOST"] = HOST
    env["PREFECT_SERVER_API_PORT"] = str(port)
    env["PREFECT_UI_API_URL"] = f"{url}/api"
    record = start_process("prefect-server", [_bin("prefect"), "server", "start", "--host", HOST, "--port", str(port)],
                           directory / "logs" / "prefect-server.log", env=env, cwd=directory, url=url)
    wait_until(lambda: _http_ok(f"{url}/api/health", lambda body: body.strip() == b"true"), record,
               f"a healthy API at {url}/api/health", timeout_s)
    return record


def start_mlflow_server(directory: Path, artifacts_dir: Path, port: int, timeout_s: float = 120.0) -> ServiceRecord:
    """`mlflow server` on 127.0.0.1:port: sqlite backend under `directory`, artifacts served from `artifacts_dir`."""
    url = f"http://{HOST}:{port}"
    artifacts_dir.mkdir(parents=True, exist_ok=True)
    command = [_bin("mlflow"), "server", "--host", HOST, "--port", str(port), "--workers", "1",
               "--backend-store-uri", f"sqlite:///{directory / 'mlflow.db'}",
               "--artifacts-destination", str(artifacts_dir), "--serve-artifacts"]
    # The server's job runner (GenAI evaluation jobs) starts a pool of consumer processes; tfdag needs none.
    env = _base_env({"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
    record = start_process("mlflow-server", command, directory / "logs" / "mlflow-server.log", env=env,
                           cwd=directory, url=url)
    wait_until(lambda: _http_ok(f"{url}/health"), record, f"a healthy server at {url}/health", timeout_s)
    return record


def create_work_pool(directory: Path, api_url: str, name: str = WORK_POOL) -> None:
    """Create the process work pool (kept as it is when it exists)."""
    env = prefect_env(directory, api_url)
    log = directory / "logs" / "setup.log"
    exists = _run([_bin("prefect"), "work-pool", "inspect", name], env=env, cwd=directory, log_path=log,
                  check=False, timeout_s=120)
    if exists.returncode != 0:
        _run([_bin("prefect"), "work-pool", "create", name, "--type", "process"], env=env, cwd=directory,
             log_path=log, timeout_s=120)


def _worker_online(api_url: str, pool: str) -> bool:
    request = urllib.request.Request(f"{api_url}/work_pools/{pool}/workers/filter", data=b"{}", method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=2) as response:
            workers = json.loads(response.read())
    except (urllib.error.URLError, OSError, ValueError):
        return False
    return any(w.get("name") == WORKER_NAME and w.get("status") == "ONLINE" for w in workers)


def start_worker(directory: Path, api_url: str, mlflow_url: str, project_dir: Path, pool: str = WORK_POOL,
                 timeout_s: float = 120.0, ray_address: str | None = None) -> ServiceRecord:
    """A process worker on the pool; its flow runs get MLFLOW_TRACKING_URI, RAY_ADDRESS (with `--ray`) and the
    project on PYTHONPATH."""
    env = prefect_env(directory, api_url)
    env["MLFLOW_TRACKING_URI"] = mlflow_url
    if ray_address:
        env["RAY_ADDRESS"] = ray_address
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(project_dir), os.environ.get("PYTHONPATH", "")) if p)
    # Pick up new flow runs within seconds, not the default 10 s.
    env.setdefault("PREFECT_WORKER_QUERY_SECONDS", "2")
    command = [_bin("prefect"), "worker", "start", "--pool", pool, "--type", "process", "--name", WORKER_NAME]
    record = start_process("worker", command, directory / "logs" / "worker.log", env=env, cwd=project_dir)
    wait_until(lambda: _worker_online(api_url, pool), record, f"ONLINE in work pool {pool!r}", timeout_s)
    return record


def deploy(directory: Path, api_url: str, project_dir: Path, prefect_file: Path = PREFECT_FILE) -> tuple[str, ...]:
    """`prefect --no-prompt deploy --all` from the project root; returns the deployment names it created."""
    env = prefect_env(directory, api_url)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(project_dir), os.environ.get("PYTHONPATH", "")) if p)
    result = _run([_bin("prefect"), "--no-prompt", "deploy", "--all", "--prefect-file", str(prefect_file)],
                  env=env, cwd=project_dir, log_path=directory / "logs" / "deploy.log", timeout_s=600)
    names = tuple(dict.fromkeys(re.findall(r"Deployment '([^']+)' successfully created", result.stdout)))
    if not names:
        raise StackError(f"`prefect deploy` created no deployment from {project_dir / prefect_file}; see "
                         f"{directory / 'logs' / 'deploy.log'}:\n{result.stdout[-3000:]}")
    return names


# --- the Prefect profile ------------------------------------------------------------------------------------

def _user_prefect(*args: str) -> subprocess.CompletedProcess:
    """The `prefect` CLI as the user's shell sees it (their PREFECT_HOME and profiles, not the stack's)."""
    env = _base_env()
    env.pop("PREFECT_API_URL", None)
    env.pop("PREFECT_PROFILE", None)
    return subprocess.run([_bin("prefect"), *args], env=env, capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL, check=False)


def active_profile() -> str | None:
    """The user's active Prefect profile name."""
    match = re.search(r"PREFECT_PROFILE='([^']+)'", _user_prefect("config", "view").stdout)
    return match.group(1) if match else None


def use_profile(api_url: str, name: str = PROFILE) -> str | None:
    """Point a Prefect profile at the stack's API and make it active, so a plain `prefect ...` reaches the stack.

    Returns:
        The profile that was active before (`down` switches back to it).
    """
    previous = active_profile()
    _user_prefect("profile", "create", name)  # fails harmlessly when it exists
    for args in (("--profile", name, "config", "set", f"PREFECT_API_URL={api_url}"), ("profile", "use", name)):
        result = _user_prefect(*args)
        if result.returncode != 0:
            raise StackError(f"`prefect {' '.join(args)}` failed: {(result.stdout + result.stderr)[-2000:]}")
    return previous if previous != name else None


# --- up / down / status -------------------------------------------------------------------------------------

def service_status(record: ServiceRecord) -> ServiceStatus:
    process = find_process(record)
    if process is None:
        return ServiceStatus(name=record.name, pid=record.pid, running=False, url=record.url,
                             detail="not running (exited, or its pid now belongs to another process)")
    healthy = True
    if record.name == "prefect-server" and record.url:
        healthy = _http_ok(f"{record.url}/api/health")
    elif record.name == "mlflow-server" and record.url:
        healthy = _http_ok(f"{record.url}/health")
    started = _dt.datetime.fromtimestamp(record.create_time, _dt.UTC).isoformat(timespec="seconds")
    return ServiceStatus(name=record.name, pid=record.pid, running=True, url=record.url,
                         detail=f"running since {started}" + ("" if healthy else ", NOT answering its health check"))


def stack_status(root: str | os.PathLike[str] = DEFAULT_ROOT) -> tuple[StackState | None, list[ServiceStatus]]:
    """The recorded stack and each of its processes' status."""
    state = read_state(root)
    if state is None:
        return None, []
    return state, [service_status(record) for record in state.services]


def _env_file_text(state: StackState) -> str:
    ray = f"export RAY_ADDRESS={state.ray.address}\n" if state.ray is not None else ""
    return (f"export PREFECT_API_URL={state.prefect_api_url}\n"
            f"export MLFLOW_TRACKING_URI={state.mlflow_url}\n") + ray


def stack_up(root: str | os.PathLike[str] = DEFAULT_ROOT, *, project_dir: str | os.PathLike[str] | None = None,
             prefect_port: int | None = None, mlflow_port: int | None = None, profile: str | None = PROFILE,
             prefect_file: Path = PREFECT_FILE, log_fn: Callable[[str], None] = logger.info,
             ray_nodes: int = 0) -> StackState:
    """Start the Prefect server, the MLflow server, the work pool, a process worker, then deploy prefect.yaml.

    Everything binds 127.0.0.1. State, logs and both servers' data live under `<root>/stack/`; MLflow's
    artifacts under `<root>/mlartifacts/`. When a recorded stack is fully running it is returned as it is;
    a partly running one is stopped first.

    Args:
        root: the state directory (`./.tfdag`).
        project_dir: the tfdag checkout to deploy from and run flows in (default: this one).
        prefect_port: None prefers 4200 when free, 0 picks any free port, else exactly this one.
        mlflow_port: the same, preferring 5000.
        profile: the Prefect profile to point at the stack and activate (None leaves profiles alone).
        prefect_file: the deployments file, relative to project_dir.
        log_fn: progress lines.
        ray_nodes: with N > 0, also a local Ray cluster of N nodes on 127.0.0.2 (`flows.ray_stack`); the
            stack's worker gets its RAY_ADDRESS, so `train.launcher: ray` configs train on it.

    Returns:
        The StackState (also in <root>/stack/stack.json).

    Raises:
        StackError: when a port is taken or a service does not come up; what was started is stopped again.
    """
    directory = stack_dir(root)
    project = Path(project_dir).resolve() if project_dir else PROJECT_DIR
    current, statuses = stack_status(root)
    if current is not None:
        if statuses and all(s.running for s in statuses):
            log_fn(f"the stack under {directory} is already up")
            return current
        log_fn(f"the recorded stack under {directory} is partly down; stopping what is left first")
        stack_down(root, log_fn=log_fn)
    if not (project / prefect_file).is_file():
        raise StackError(f"{project / prefect_file} does not exist; run `tfdag stack up` from a tfdag checkout")
    directory.mkdir(parents=True, exist_ok=True)
    prefect_port = choose_port(prefect_port, PREFERRED_PREFECT_PORT, "Prefect server")
    mlflow_port = choose_port(mlflow_port, PREFERRED_MLFLOW_PORT, "MLflow server")
    if mlflow_port == prefect_port:
        mlflow_port = free_port()
    started: list[ServiceRecord] = []
    ray: RayClusterRecord | None = None
    try:
        if ray_nodes:
            log_fn(f"starting a Ray cluster of {ray_nodes} node(s) on {RAY_HOST} ...")
            try:
                ray = start_ray_cluster(ray_nodes, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                    p for p in (str(project), os.environ.get("PYTHONPATH", "")) if p)})
            except RayClusterError as error:
                raise StackError(str(error)) from None
            log_fn(f"Ray cluster at {ray.address} (dashboard {ray.dashboard_url})")
        log_fn(f"starting the Prefect server on {HOST}:{prefect_port} ...")
        started.append(start_prefect_server(directory, prefect_port))
        api_url = f"http://{HOST}:{prefect_port}/api"
        log_fn(f"starting the MLflow server on {HOST}:{mlflow_port} ...")
        started.append(start_mlflow_server(directory, directory.parent / "mlartifacts", mlflow_port))
        mlflow_url = f"http://{HOST}:{mlflow_port}"
        log_fn(f"creating work pool {WORK_POOL!r} and starting a process worker ...")
        create_work_pool(directory, api_url)
        started.append(start_worker(directory, api_url, mlflow_url, project,
                                    ray_address=ray.address if ray is not None else None))
        log_fn(f"deploying {prefect_file} ...")
        names = deploy(directory, api_url, project, prefect_file)
        previous = use_profile(api_url, profile) if profile else None
    except BaseException:
        for record in reversed(started):
            stop_process(record)
        if ray is not None:
            stop_ray_cluster(ray)
        raise
    state = StackState(root=str(Path(root).expanduser().resolve()), project_dir=str(project),
                       prefect_ui_url=f"http://{HOST}:{prefect_port}", prefect_api_url=api_url, mlflow_url=mlflow_url,
                       work_pool=WORK_POOL, services=tuple(started), deployments=names, ray=ray,
                       profile=profile, previous_profile=previous, started_at=_now())
    _write_state(root, state)
    (directory / ENV_NAME).write_text(_env_file_text(state))
    return state


def stack_down(root: str | os.PathLike[str] = DEFAULT_ROOT, *,
               log_fn: Callable[[str], None] = logger.info) -> list[str]:
    """Stop exactly the recorded processes (pid and start time must match), worker first; restore the profile.

    Returns:
        One line per service saying what happened.
    """
    state = read_state(root)
    if state is None:
        log_fn(f"no stack recorded under {stack_dir(root)}")
        return []
    order = {name: i for i, name in enumerate(STOP_ORDER)}
    lines = []
    for record in sorted(state.services, key=lambda r: order.get(r.name, len(order))):
        line = stop_process(record)
        log_fn(line)
        lines.append(line)
    if state.ray is not None:
        line = stop_ray_cluster(state.ray)
        log_fn(line)
        lines.append(line)
    if state.profile and state.previous_profile and active_profile() == state.profile:
        result = _user_prefect("profile", "use", state.previous_profile)
        if result.returncode == 0:
            log_fn(f"Prefect profile {state.previous_profile!r} is active again")
    state_path(root).unlink(missing_ok=True)
    (stack_dir(root) / ENV_NAME).unlink(missing_ok=True)
    return lines


def _print_addresses(state: StackState, out: IO[str]) -> None:
    print(f"Prefect UI:      {state.prefect_ui_url}", file=out)
    print(f"Prefect API:     {state.prefect_api_url}", file=out)
    print(f"MLflow UI:       {state.mlflow_url}", file=out)
    print(f"work pool:       {state.work_pool} (process worker {WORKER_NAME})", file=out)
    if state.deployments:
        print(f"deployments:     {', '.join(state.deployments)}", file=out)
    if state.ray is not None:
        print(f"Ray cluster:     {state.ray.address} ({state.ray.num_nodes} nodes; RAY_ADDRESS for "
              f"train.launcher: ray), dashboard {state.ray.dashboard_url}", file=out)
    print(f"state and logs:  {stack_dir(state.root)}", file=out)


def stack_command(action: str, root: str | os.PathLike[str] = DEFAULT_ROOT, out: IO[str] = sys.stdout,
                  ray_nodes: int = 0) -> int:
    """`tfdag stack up|down|status`.

    Ports come from TFDAG_PREFECT_PORT and TFDAG_MLFLOW_PORT (0: any free port; unset: 4200 and 5000 when
    free); TFDAG_STACK_PROFILE names the Prefect profile to activate ("" leaves profiles alone).

    Returns:
        The exit code: 0, or 1 when the stack cannot start or (status) is not fully running.
    """
    def say(line: str) -> None:
        print(line, file=out, flush=True)

    try:
        if action == "up":
            profile = os.environ.get("TFDAG_STACK_PROFILE", PROFILE) or None
            state = stack_up(root, prefect_port=_env_port("TFDAG_PREFECT_PORT"),
                             mlflow_port=_env_port("TFDAG_MLFLOW_PORT"), profile=profile, log_fn=say,
                             ray_nodes=ray_nodes)
            say("")
            _print_addresses(state, out)
            say("")
            if state.profile:
                say(f"The Prefect profile {state.profile!r} now points at this server, so in any shell:")
            else:
                say(f"In your shell: source {stack_dir(state.root) / ENV_NAME}   (sets PREFECT_API_URL)")
            say("  prefect deployment run 'retrain/nightly' --watch")
            say(f"then open {state.prefect_ui_url}/runs for the flow run and its artifacts, and "
                f"{state.mlflow_url}/#/models for the model and its `champion` alias.")
            return 0
        if action == "down":
            lines = stack_down(root, log_fn=say)
            if lines:
                say("stack stopped")
            return 0
        if action == "status":
            state, statuses = stack_status(root)
            if state is None:
                say(f"no stack recorded under {stack_dir(root)}; start one with `tfdag stack up`")
                return 1
            for status in statuses:
                say(f"{status.name:15s} pid {status.pid:<8d} {status.detail}" + (f"  {status.url}" if status.url else ""))
            say("")
            _print_addresses(state, out)
            return 0 if all(s.running for s in statuses) else 1
    except StackError as error:
        print(f"tfdag stack {action}: {error}", file=sys.stderr)
        return 1
    print(f"tfdag stack: unknown action {action!r}; use up, down or status", file=sys.stderr)
    return 2
