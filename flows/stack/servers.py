"""Starting the stack's servers and setting up Prefect: the Prefect and MLflow servers, the work pool and its
process worker, the deployments."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path

from flows.stack.processes import (
    ServiceRecord,
    StackError,
    base_env,
    console_script,
    http_ok,
    run_command,
    start_process,
    wait_until,
)
from flows.stack.state import HOST

WORK_POOL = "tfdag-local"
WORKER_NAME = "tfdag-local-worker"
PREFECT_FILE = Path("deployments") / "prefect.yaml"


def prefect_env(directory: Path, api_url: str | None = None) -> dict[str, str]:
    """The environment of the stack's Prefect processes: their own PREFECT_HOME (database, results) under the stack."""
    env = base_env({"PREFECT_HOME": str(directory / "prefect-home")})
    env.pop("PREFECT_PROFILES_PATH", None)
    if api_url:
        env["PREFECT_API_URL"] = api_url
    else:
        env.pop("PREFECT_API_URL", None)
    return env


def prefect_server_answers(api_url: str) -> bool:
    """Whether the Prefect API at `api_url` (ending in /api) answers its health check."""
    return http_ok(f"{api_url}/health")


def start_prefect_server(directory: Path, port: int, timeout_s: float = 120.0) -> ServiceRecord:
    """`prefect server start` on 127.0.0.1:port with a sqlite database under `directory`; waits for /api/health."""
    url = f"http://{HOST}:{port}"
    env = prefect_env(directory)
    env["PREFECT_SERVER_API_HOST"] = HOST
    env["PREFECT_SERVER_API_PORT"] = str(port)
    env["PREFECT_UI_API_URL"] = f"{url}/api"
    record = start_process("prefect-server", [console_script("prefect"), "server", "start", "--host", HOST, "--port", str(port)],
                           directory / "logs" / "prefect-server.log", env=env, cwd=directory, url=url)
    wait_until(lambda: http_ok(f"{url}/api/health", lambda body: body.strip() == b"true"), record,
               f"a healthy API at {url}/api/health", timeout_s)
    return record


def start_mlflow_server(directory: Path, artifacts_dir: Path, port: int, timeout_s: float = 120.0) -> ServiceRecord:
    """`mlflow server` on 127.0.0.1:port: sqlite backend under `directory`, artifacts served from `artifacts_dir`."""
    url = f"http://{HOST}:{port}"
    artifacts_dir.mkdir(parents=True, exist_ok=True)
    command = [console_script("mlflow"), "server", "--host", HOST, "--port", str(port), "--workers", "1",
               "--backend-store-uri", f"sqlite:///{directory / 'mlflow.db'}",
               "--artifacts-destination", str(artifacts_dir), "--serve-artifacts"]
    # The server's job runner (GenAI evaluation jobs) starts a pool of consumer processes; tfdag needs none.
    env = base_env({"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
    record = start_process("mlflow-server", command, directory / "logs" / "mlflow-server.log", env=env,
                           cwd=directory, url=url)
    wait_until(lambda: http_ok(f"{url}/health"), record, f"a healthy server at {url}/health", timeout_s)
    return record


def create_work_pool(directory: Path, api_url: str, name: str = WORK_POOL) -> None:
    """Create the process work pool (kept as it is when it exists)."""
    env = prefect_env(directory, api_url)
    log = directory / "logs" / "setup.log"
    exists = run_command([console_script("prefect"), "work-pool", "inspect", name], env=env, cwd=directory, log_path=log,
                         check=False, timeout_s=120)
    if exists.returncode != 0:
        run_command([console_script("prefect"), "work-pool", "create", name, "--type", "process"], env=env, cwd=directory,
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


def start_worker(directory: Path, api_url: str, exports: Mapping[str, str], python_path: str, project_dir: Path,
                 pool: str = WORK_POOL, timeout_s: float = 120.0) -> ServiceRecord:
    """A process worker on the pool; its flow runs get the stack's `exports` (MLFLOW_TRACKING_URI, RAY_ADDRESS
    with `--ray`) and `python_path`."""
    env = prefect_env(directory, api_url)
    env.update(exports)
    env["PYTHONPATH"] = python_path
    # Pick up new flow runs within seconds, not the default 10 s.
    env.setdefault("PREFECT_WORKER_QUERY_SECONDS", "2")
    command = [console_script("prefect"), "worker", "start", "--pool", pool, "--type", "process", "--name", WORKER_NAME]
    record = start_process("worker", command, directory / "logs" / "worker.log", env=env, cwd=project_dir)
    wait_until(lambda: _worker_online(api_url, pool), record, f"ONLINE in work pool {pool!r}", timeout_s)
    return record


def deploy(directory: Path, api_url: str, project_dir: Path, python_path: str,
           prefect_file: Path = PREFECT_FILE) -> tuple[str, ...]:
    """`prefect --no-prompt deploy --all` from the project root; returns the deployment names it created."""
    env = prefect_env(directory, api_url)
    env["PYTHONPATH"] = python_path
    result = run_command([console_script("prefect"), "--no-prompt", "deploy", "--all", "--prefect-file", str(prefect_file)],
                         env=env, cwd=project_dir, log_path=directory / "logs" / "deploy.log", timeout_s=600)
    names = tuple(dict.fromkeys(re.findall(r"Deployment '([^']+)' successfully created", result.stdout)))
    if not names:
        raise StackError(f"`prefect deploy` created no deployment from {project_dir / prefect_file}; see "
                         f"{directory / 'logs' / 'deploy.log'}:\n{result.stdout[-3000:]}")
    return names
