"""The stack's state file (<root>/stack/stack.json) and the choice of its ports."""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from flows.stack.processes import ServiceRecord, StackError
from flows.stack.ray_cluster import RayClusterRecord
from pipeline_lib.core.net import LOOPBACK, free_port, is_port_free

HOST = LOOPBACK
STATE_NAME = "stack.json"
ENV_NAME = "env"


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


def write_state(root: str | os.PathLike[str], state: StackState) -> None:
    """Write the state file atomically (a reader sees the old state or the new one)."""
    path = state_path(root)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(state.model_dump_json(indent=2))
    os.replace(tmp, path)


def forget_state(root: str | os.PathLike[str]) -> None:
    """Remove the state file and the env file: `down` finished."""
    state_path(root).unlink(missing_ok=True)
    (stack_dir(root) / ENV_NAME).unlink(missing_ok=True)


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


def env_port(name: str) -> int | None:
    """The port in environment variable `name` (None when unset or empty; 0 picks a free one).

    Raises:
        StackError: when it is not a port number.
    """
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
