"""`tfdag stack up|down|status`: start the services in order, stop them in reverse, report where they are."""

from __future__ import annotations

import datetime as _dt
import logging
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO

from pydantic import BaseModel, ConfigDict

from flows.stack.processes import ServiceRecord, StackError, find_process, now
from flows.stack.profile import PROFILE, restore_profile, use_profile
from flows.stack.services import (
    PREFECT_FILE,
    Service,
    StackContext,
    create_services,
    env_file_text,
    services_of,
)
from flows.stack.state import (
    ENV_NAME,
    StackState,
    choose_port,
    env_port,
    forget_state,
    read_state,
    stack_dir,
    write_state,
)
from pipeline_lib.config import DEFAULT_ROOT
from pipeline_lib.core.exit_codes import EXIT_BAD_INPUT, EXIT_FAILURE, EXIT_OK
from pipeline_lib.core.net import free_port

logger = logging.getLogger(__name__)

PROJECT_DIR = Path(__file__).resolve().parents[2]


class ServiceStatus(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    pid: int
    running: bool
    detail: str
    url: str | None = None


def service_status(record: ServiceRecord, state: StackState) -> ServiceStatus:
    """Whether the recorded process runs and, for a server, answers its health check."""
    if find_process(record) is None:
        return ServiceStatus(name=record.name, pid=record.pid, running=False, url=record.url,
                             detail="not running (exited, or its pid now belongs to another process)")
    service = next((s for s in services_of(state) if s.name == record.name), None)
    healthy = service is None or service.is_healthy(record)
    started = _dt.datetime.fromtimestamp(record.create_time, _dt.UTC).isoformat(timespec="seconds")
    return ServiceStatus(name=record.name, pid=record.pid, running=True, url=record.url,
                         detail=f"running since {started}" + ("" if healthy else ", NOT answering its health check"))


def stack_status(root: str | os.PathLike[str] = DEFAULT_ROOT) -> tuple[StackState | None, list[ServiceStatus]]:
    """The recorded stack and each of its processes' status."""
    state = read_state(root)
    if state is None:
        return None, []
    return state, [service_status(record, state) for record in state.services]


def choose_ports(services: tuple[Service, ...], configured: Mapping[str, int | None]) -> dict[str, int]:
    """The port of every service that listens on one, by name, chosen before anything starts (all different).

    Raises:
        StackError: when a configured port is taken.
    """
    ports: dict[str, int] = {}
    for service in services:
        if service.preferred_port is not None:
            port = choose_port(configured.get(service.name), service.preferred_port, service.title)
            ports[service.name] = free_port() if port in ports.values() else port
    return ports


def configured_ports() -> dict[str, int | None]:
    """The ports the environment configures (TFDAG_PREFECT_PORT, TFDAG_MLFLOW_PORT), by service name."""
    return {s.name: env_port(s.port_env) for s in create_services() if s.port_env}


def stack_up(root: str | os.PathLike[str] = DEFAULT_ROOT, *, project_dir: str | os.PathLike[str] | None = None,
             ports: Mapping[str, int | None] | None = None, profile: str | None = PROFILE,
             prefect_file: Path = PREFECT_FILE, log_fn: Callable[[str], None] = logger.info,
             ray_nodes: int = 0) -> StackState:
    """Start the stack's services (`services.create_services`) in order, then point a Prefect profile at it.

    Everything binds 127.0.0.1 (a Ray cluster 127.0.0.2). State, logs and both servers' data live under
    `<root>/stack/`; MLflow's artifacts under `<root>/mlartifacts/`. When a recorded stack is fully running it is
    returned as it is; a partly running one is stopped first.

    Args:
        root: the state directory (`./.tfdag`).
        project_dir: the tfdag checkout to deploy from and run flows in (default: this one).
        ports: by service name ("prefect-server", "mlflow-server"): absent or None prefers the service's own
            port (4200, 5000) when free, 0 picks any free port, else exactly this one.
        profile: the Prefect profile to point at the stack and activate (None leaves profiles alone).
        prefect_file: the deployments file, relative to project_dir.
        log_fn: progress lines.
        ray_nodes: with N > 0, also a local Ray cluster of N nodes; the stack's worker gets its RAY_ADDRESS.

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
    services = create_services(ray_nodes=ray_nodes, prefect_file=prefect_file)
    stack = StackContext(directory=directory, project_dir=project, ports=choose_ports(services, ports or {}),
                         log_fn=log_fn)
    try:
        for service in services:
            service.start(stack)
            stack.exports.update(service.exports(stack.fields))
        previous = use_profile(stack.fields["prefect_api_url"], profile) if profile else None
    except BaseException:
        for undo in reversed(stack.undo):
            undo()
        raise
    state = StackState(root=str(Path(root).expanduser().resolve()), project_dir=str(project),
                       services=tuple(stack.records), profile=profile, previous_profile=previous, started_at=now(),
                       **stack.fields)
    write_state(root, state)
    (directory / ENV_NAME).write_text(env_file_text(state))
    return state


def stack_down(root: str | os.PathLike[str] = DEFAULT_ROOT, *,
               log_fn: Callable[[str], None] = logger.info) -> list[str]:
    """Stop exactly what was recorded (pid and start time must match), in the reverse of the start order, so the
    worker goes first and nothing new starts while the servers are still up to record it; restore the profile.

    Returns:
        One line per thing stopped.
    """
    state = read_state(root)
    if state is None:
        log_fn(f"no stack recorded under {stack_dir(root)}")
        return []
    lines = []
    for service in reversed(services_of(state)):
        for line in service.stop(state):
            log_fn(line)
            lines.append(line)
    restored = restore_profile(state.profile, state.previous_profile)
    if restored:
        log_fn(restored)
    forget_state(root)
    return lines


def print_addresses(state: StackState, out: IO[str]) -> None:
    """Where each service is, then where the state and logs are."""
    for service in services_of(state):
        for line in service.describe(state):
            print(line, file=out)
    print(f"state and logs:  {stack_dir(state.root)}", file=out)


def _up(root: str | os.PathLike[str], ray_nodes: int, say: Callable[[str], None], out: IO[str]) -> int:
    profile = os.environ.get("TFDAG_STACK_PROFILE", PROFILE) or None
    state = stack_up(root, ports=configured_ports(), profile=profile, log_fn=say, ray_nodes=ray_nodes)
    say("")
    print_addresses(state, out)
    say("")
    if state.profile:
        say(f"The Prefect profile {state.profile!r} now points at this server, so in any shell:")
    else:
        say(f"In your shell: source {stack_dir(state.root) / ENV_NAME}   (sets PREFECT_API_URL)")
    say("  prefect deployment run 'retrain/nightly' --watch")
    say(f"then open {state.prefect_ui_url}/runs for the flow run and its artifacts, and "
        f"{state.mlflow_url}/#/models for the model and its `champion` alias.")
    return EXIT_OK


def _status(root: str | os.PathLike[str], say: Callable[[str], None], out: IO[str]) -> int:
    state, statuses = stack_status(root)
    if state is None:
        say(f"no stack recorded under {stack_dir(root)}; start one with `tfdag stack up`")
        return EXIT_FAILURE
    for status in statuses:
        say(f"{status.name:15s} pid {status.pid:<8d} {status.detail}" + (f"  {status.url}" if status.url else ""))
    say("")
    print_addresses(state, out)
    return EXIT_OK if all(s.running for s in statuses) else EXIT_FAILURE


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
            return _up(root, ray_nodes, say, out)
        if action == "down":
            if stack_down(root, log_fn=say):
                say("stack stopped")
            return EXIT_OK
        if action == "status":
            return _status(root, say, out)
    except StackError as error:
        print(f"tfdag stack {action}: {error}", file=sys.stderr)
        return EXIT_FAILURE
    print(f"tfdag stack: unknown action {action!r}; use up, down or status", file=sys.stderr)
    return EXIT_BAD_INPUT
