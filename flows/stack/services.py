"""The stack's services, each described once: how `up` starts it, how `down` stops it, how it is reached.

The Prefect server, the MLflow server, the work pool with its process worker, the deployments and (with
`up --ray N`) a local Ray cluster are each a `Service`. `up` starts them in list order, handing each a
`StackContext` with what the earlier ones left (their URLs, the environment variables their users need);
`down` stops them in the reverse order.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from flows.stack.processes import ServiceRecord, http_ok, stop_process
from flows.stack.ray_cluster import RAY_HOST, start_ray_cluster, stop_ray_cluster
from flows.stack.servers import (
    PREFECT_FILE,
    WORK_POOL,
    WORKER_NAME,
    create_work_pool,
    deploy,
    start_mlflow_server,
    start_prefect_server,
    start_worker,
)
from flows.stack.state import HOST, StackState


@dataclass
class StackContext:
    """What `up` hands from one service to the next: where things go, and what the started ones left."""

    directory: Path  # <root>/stack
    project_dir: Path
    ports: Mapping[str, int]  # by service name: the ports chosen for the services that listen on one
    log_fn: Callable[[str], None]
    # What the services started so far export (`Service.exports`): the worker's flow runs get them.
    exports: dict[str, str] = field(default_factory=dict)
    records: list[ServiceRecord] = field(default_factory=list)
    fields: dict[str, Any] = field(default_factory=dict)  # the StackState fields the services fill in
    undo: list[Callable[[], object]] = field(default_factory=list)  # run in reverse when a later service fails

    def python_path(self) -> str:
        """PYTHONPATH with the project first: the stack's processes import tfdag from the checkout."""
        return os.pathsep.join(p for p in (str(self.project_dir), os.environ.get("PYTHONPATH", "")) if p)

    def started(self, record: ServiceRecord) -> None:
        self.records.append(record)
        self.undo.append(lambda: stop_process(record))


class Service(Protocol):
    """One part of the local stack."""

    name: str
    title: str  # in words, for messages
    preferred_port: int | None  # a server's port when free and not configured; None: it needs no port
    port_env: str | None  # the environment variable that configures that port (0: any free port)

    def start(self, stack: StackContext) -> None:
        """Start it and record what it left in `stack` (records, exports, state fields, how to undo it)."""

    def stop(self, state: StackState) -> list[str]:
        """Stop what the state records of it; one line per thing stopped."""

    def exports(self, fields: Mapping[str, Any]) -> dict[str, str]:
        """The environment variables a user of the stack needs for it, from the StackState's `fields`."""

    def describe(self, state: StackState) -> list[str]:
        """Its address lines in `up`'s and `status`'s report."""

    def is_healthy(self, record: ServiceRecord) -> bool:
        """Whether its recorded process answers as it should (`status`)."""


@dataclass(frozen=True)
class _ProcessService:
    """A service that is one recorded process: `down` stops exactly that process."""

    name: str
    title: str
    health_path: str | None = None  # `status` checks <url><health_path>
    preferred_port: int | None = None
    port_env: str | None = None

    def exports(self, fields: Mapping[str, Any]) -> dict[str, str]:
        return {}

    def stop(self, state: StackState) -> list[str]:
        record = state.service(self.name)
        return [stop_process(record)] if record is not None else []

    def is_healthy(self, record: ServiceRecord) -> bool:
        return self.health_path is None or record.url is None or http_ok(f"{record.url}{self.health_path}")


@dataclass(frozen=True)
class PrefectServer(_ProcessService):
    name: str = "prefect-server"
    title: str = "Prefect server"
    health_path: str | None = "/api/health"
    preferred_port: int | None = 4200
    port_env: str | None = "TFDAG_PREFECT_PORT"

    def start(self, stack: StackContext) -> None:
        port = stack.ports[self.name]
        stack.log_fn(f"starting the Prefect server on {HOST}:{port} ...")
        stack.started(start_prefect_server(stack.directory, port))
        stack.fields.update(prefect_ui_url=f"http://{HOST}:{port}", prefect_api_url=f"http://{HOST}:{port}/api")

    def exports(self, fields: Mapping[str, Any]) -> dict[str, str]:
        return {"PREFECT_API_URL": fields["prefect_api_url"]}

    def describe(self, state: StackState) -> list[str]:
        return [f"Prefect UI:      {state.prefect_ui_url}", f"Prefect API:     {state.prefect_api_url}"]


@dataclass(frozen=True)
class MlflowServer(_ProcessService):
    name: str = "mlflow-server"
    title: str = "MLflow server"
    health_path: str | None = "/health"
    preferred_port: int | None = 5000
    port_env: str | None = "TFDAG_MLFLOW_PORT"

    def start(self, stack: StackContext) -> None:
        port = stack.ports[self.name]
        stack.log_fn(f"starting the MLflow server on {HOST}:{port} ...")
        stack.started(start_mlflow_server(stack.directory, stack.directory.parent / "mlartifacts", port))
        stack.fields["mlflow_url"] = f"http://{HOST}:{port}"

    def exports(self, fields: Mapping[str, Any]) -> dict[str, str]:
        return {"MLFLOW_TRACKING_URI": fields["mlflow_url"]}

    def describe(self, state: StackState) -> list[str]:
        return [f"MLflow UI:       {state.mlflow_url}"]


@dataclass(frozen=True)
class Worker(_ProcessService):
    name: str = "worker"
    title: str = "process worker"

    def start(self, stack: StackContext) -> None:
        stack.log_fn(f"creating work pool {WORK_POOL!r} and starting a process worker ...")
        api_url = stack.exports["PREFECT_API_URL"]
        create_work_pool(stack.directory, api_url)
        stack.started(start_worker(stack.directory, api_url, stack.exports, stack.python_path(), stack.project_dir))
        stack.fields["work_pool"] = WORK_POOL

    def describe(self, state: StackState) -> list[str]:
        return [f"work pool:       {state.work_pool} (process worker {WORKER_NAME})"]


@dataclass(frozen=True)
class Deployments:
    """The deployments of prefect.yaml: records on the Prefect server, nothing to stop."""

    prefect_file: Path = PREFECT_FILE
    name: str = "deployments"
    title: str = "deployments"
    preferred_port: int | None = None
    port_env: str | None = None

    def start(self, stack: StackContext) -> None:
        stack.log_fn(f"deploying {self.prefect_file} ...")
        stack.fields["deployments"] = deploy(stack.directory, stack.exports["PREFECT_API_URL"], stack.project_dir,
                                             stack.python_path(), self.prefect_file)

    def stop(self, state: StackState) -> list[str]:
        return []

    def exports(self, fields: Mapping[str, Any]) -> dict[str, str]:
        return {}

    def is_healthy(self, record: ServiceRecord) -> bool:
        return True

    def describe(self, state: StackState) -> list[str]:
        return [f"deployments:     {', '.join(state.deployments)}"] if state.deployments else []


@dataclass(frozen=True)
class RayCluster:
    """A local Ray cluster of `num_nodes` nodes on 127.0.0.2 (`flows.stack.ray_cluster`); started first so the
    worker's flow runs get its RAY_ADDRESS and `train.launcher: ray` configs train on it."""

    num_nodes: int
    name: str = "ray"
    title: str = "Ray cluster"
    preferred_port: int | None = None  # its ports are picked by `start_ray_cluster`, on 127.0.0.2
    port_env: str | None = None

    def start(self, stack: StackContext) -> None:
        stack.log_fn(f"starting a Ray cluster of {self.num_nodes} node(s) on {RAY_HOST} ...")
        record = start_ray_cluster(self.num_nodes, env={**os.environ, "PYTHONPATH": stack.python_path()})
        stack.undo.append(lambda: stop_ray_cluster(record))
        stack.fields["ray"] = record
        stack.log_fn(f"Ray cluster at {record.address} (dashboard {record.dashboard_url})")

    def stop(self, state: StackState) -> list[str]:
        return [stop_ray_cluster(state.ray)] if state.ray is not None else []

    def exports(self, fields: Mapping[str, Any]) -> dict[str, str]:
        return {"RAY_ADDRESS": fields["ray"].address} if fields.get("ray") is not None else {}

    def is_healthy(self, record: ServiceRecord) -> bool:
        return True

    def describe(self, state: StackState) -> list[str]:
        if state.ray is None:
            return []
        return [(f"Ray cluster:     {state.ray.address} ({state.ray.num_nodes} nodes; RAY_ADDRESS for "
                f"train.launcher: ray), dashboard {state.ray.dashboard_url}")]


def create_services(*, ray_nodes: int = 0, prefect_file: Path = PREFECT_FILE) -> tuple[Service, ...]:
    """The stack's services in start order: the one place that lists them (a Ray cluster when asked for)."""
    ray: tuple[Service, ...] = (RayCluster(ray_nodes),) if ray_nodes else ()
    return (*ray, PrefectServer(), MlflowServer(), Worker(), Deployments(prefect_file))


def services_of(state: StackState) -> tuple[Service, ...]:
    """The services a recorded stack was started with."""
    return create_services(ray_nodes=state.ray.num_nodes if state.ray is not None else 0)


def env_file_text(state: StackState) -> str:
    """<root>/stack/env: what a shell needs to reach the stack, every service's exports."""
    fields = dict(state)
    return "".join(f"export {name}={value}\n" for service in services_of(state)
                   for name, value in service.exports(fields).items())
