"""The Ray launcher (`train.launcher: ray`): each task of the training cluster in a Ray actor on its own bundle.

A placement group reserves one bundle of `train.ray.resources_per_worker` per task (chief, workers, parameter
servers), `STRICT_SPREAD` (one task per node) or `PACK`. Each task's actor (`ray_task.TaskRunner`) runs on its
bundle's node, finds a port free on that node, and starts the same worker process the local launcher starts, with
a TF_CONFIG of node IPs and those ports. Ray places; tfdag does not SSH or run an agent of its own.

Supervision is the local launcher's, unchanged (`local.launch` with a `RayGroup`): the same exit classes, watchdog
phases, restarts and restart story. What Ray adds:

- heartbeats, exit codes and output reach the supervisor through actor calls (no shared directory); every task's
  output is logged as `[worker 1 @ 127.0.0.2] ...`;
- a lost node, a killed actor or an unreachable one is retryable (`describe_exit` says which node was lost): the
  attempt's actors are killed and its placement group removed (the fence), and the next attempt gets a new
  placement group on the nodes that remain;
- before any actor starts, the cluster is checked: a wrong address, fewer nodes than `spread` needs, or a
  resource no node has is a `RayClusterError` that names the value, what the cluster has, and the fix.

Every exit (success, failure, timeout, Ctrl-C, cancellation) kills the run's actors and removes its placement
group. Ray is imported only here, and only when a config asks for this launcher.
"""

from __future__ import annotations

import collections
import logging
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from pipeline_lib.cluster.ray_connect import (
    RayClusterError,
    connect,
    ray_module,
    resource_options,
)
from pipeline_lib.config import PipelineConfig, RayConfig, RayPlacement
from pipeline_lib.core import storage
from pipeline_lib.data.manifest import Manifest
from pipeline_lib.launch.errors import LaunchError
from pipeline_lib.launch.exits import describe_exit
from pipeline_lib.launch.local import LaunchResult, launch, plan_tasks
from pipeline_lib.launch.processes import TAIL_LINES, TaskSpec
from pipeline_lib.launch.protocol import DEFAULT_OPTIONS, LaunchOptions
from pipeline_lib.launch.ray_capacity import node_fits, placeable_workers
from pipeline_lib.launch.ray_task import TaskRunner
from pipeline_lib.launch.spec import WorkerSpec
from pipeline_lib.launch.supervisor import TrainProgress
from pipeline_lib.planning.sharding import ShardPlan
from pipeline_lib.training.results import ResizeRecord, TrainResult

logger = logging.getLogger(__name__)

STATUS_TIMEOUT_S = 10.0
# The supervisor polls every 0.1 s and several times per cycle; one actor call per task this often is enough
# (heartbeats are written every 0.5 s) and keeps the calls off the training's CPUs.
STATUS_INTERVAL_S = 0.5
KILL_TIMEOUT_S = 10.0
RAYLET_PROBE_TIMEOUT_S = 1.0


def _ray():
    return ray_module()


def _alive_nodes() -> list[dict[str, Any]]:
    return [n for n in _ray().nodes() if n.get("Alive")]


def _raylet_answers(node: Mapping[str, Any]) -> bool:
    try:
        socket.create_connection((node["NodeManagerAddress"], int(node["NodeManagerPort"])),
                                 timeout=RAYLET_PROBE_TIMEOUT_S).close()
    except (OSError, KeyError, ValueError):
        return False
    return True


def wait_until_lost_nodes_are_dead(node_ids: set[str], timeout_s: float) -> None:
    """Return once no node of `node_ids` (whose actors were lost) is a node Ray could still place a bundle on.

    A node whose raylet was killed stays ALIVE in the GCS until its health checks fail (seconds to tens of
    seconds): a placement group made meanwhile may take it. A node whose raylet still answers (only an actor
    died) is a fine place for the next attempt and is not waited for.

    Raises:
        LaunchError: a lost node is still listed alive after `timeout_s`, naming the node and the setting.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        pending = [n for n in _alive_nodes() if n["NodeID"] in node_ids and not _raylet_answers(n)]
        if not pending:
            return
        if time.monotonic() >= deadline:
            names = ", ".join(f"{n['NodeID'][:12]} ({n.get('NodeManagerAddress', '?')})" for n in pending)
            raise LaunchError(
                f"Ray node(s) {names} lost in this run (their raylet does not answer) are still listed alive by the "
                f"GCS after train.ray.placement_timeout_s ({timeout_s:g} s), and the next attempt could be placed on "
                "them; raise train.ray.placement_timeout_s, or lower the GCS's health-check period "
                "(RAY_health_check_period_ms, RAY_health_check_failure_threshold)")
        time.sleep(0.5)


def check_cluster(config: PipelineConfig, num_tasks: int) -> None:
    """Fail before any actor starts when the cluster cannot hold `num_tasks` bundles as configured.

    Raises:
        RayClusterError: a resource no node has, or fewer nodes than `spread` needs; with the numbers and the fix.
    """
    ray_config = config.train.ray
    bundle = ray_config.resources_per_worker
    nodes = _alive_nodes()
    for name, amount in bundle.items():
        most = max((n.get("Resources", {}).get(name, 0.0) for n in nodes), default=0.0)
        if amount > most:
            raise RayClusterError(
                f"train.ray.resources_per_worker asks each task for {name}: {amount:g}, but no node of the Ray "
                f"cluster has that much (the most any of its {len(nodes)} node(s) has is {most:g}); lower it, or add "
                f"nodes that have it (`ray start --resources '{{\"{name}\": {amount:g}}}'` for a custom resource)")
    fits = [n for n in nodes if node_fits(n, bundle)]
    if ray_config.placement == RayPlacement.SPREAD and len(fits) < num_tasks:
        raise RayClusterError(
            f"train.ray.placement 'spread' puts each of the {num_tasks} task(s) on its own node, but the Ray cluster "
            f"has {len(fits)} node(s) that can hold train.ray.resources_per_worker {bundle} ({len(nodes)} node(s) "
            "in all); add nodes, lower train.workers / train.parameter_servers, or set train.ray.placement: pack")


class RayTaskHandle:
    """The supervisor's view of one task's actor: polls it, streams its output, keeps its last state."""

    def __init__(self, task: TaskSpec, actor: Any, node_ip: str, node_id: str, log_fn: Callable[[str], None],
                 log_lock: threading.Lock):
        self.task = task
        self.actor = actor
        self.node_ip = node_ip
        self.node_id = node_id
        self.prefix = f"[{task.name} @ {node_ip}] "
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self._log_fn = log_fn
        self._log_lock = log_lock
        self._cursor = 0
        self._code: int | None = None
        self._beat: dict[str, Any] | None = None
        self._stopped = False
        self._polled_at = float("-inf")
        self.lost: str | None = None

    def _refresh(self, force: bool = False) -> None:
        if self._code is not None:
            return
        now = time.monotonic()
        if not force and now - self._polled_at < STATUS_INTERVAL_S:
            return
        self._polled_at = now
        ray = _ray()
        try:
            status = ray.get(self.actor.status.remote(self._cursor), timeout=STATUS_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            return  # no news: the watchdog's bounds decide whether the silence is a hang
        except ray.exceptions.RayActorError as problem:
            # The actor, its process or its node is gone: retryable, like a worker killed by a signal.
            self.lost = " ".join(str(problem).split())[:300]
            self._code = -signal.SIGKILL
            return
        self._cursor = status["cursor"]
        with self._log_lock:
            for line in status["lines"]:
                self.tail.append(line)
                try:
                    self._log_fn(self.prefix + line)
                except Exception:  # a broken log sink must not stop supervision
                    logger.debug("log_fn failed on a line of %s", self.task.name, exc_info=True)
        self._beat, self._stopped, self._code = status["heartbeat"], status["stopped"], status["code"]

    def poll(self) -> int | None:
        self._refresh()
        return self._code

    def read_heartbeat(self) -> dict[str, Any] | None:
        return self._beat

    def is_stopped(self) -> bool:
        return self._stopped

    def describe_exit(self, code: int) -> str:
        if self.lost is not None:
            return f"on node {self.node_ip} was lost: its Ray actor died ({self.lost})"
        return f"{describe_exit(code)} on node {self.node_ip} (Ray node {self.node_id[:12]})"

    def traceback_tail(self, max_lines: int = 25) -> str:
        if self.lost is None:
            try:
                return _ray().get(self.actor.traceback_tail.remote(max_lines), timeout=STATUS_TIMEOUT_S)
            except Exception:
                logger.debug("no traceback tail from %s's actor", self.task.name, exc_info=True)
        return "\n".join(list(self.tail)[-max_lines:])

    def kill(self) -> None:
        ray = _ray()
        try:  # the worker process first (its process group), then the actor
            ray.get(self.actor.kill.remote(), timeout=KILL_TIMEOUT_S)
        except Exception:
            logger.debug("%s's actor did not end its worker; killing the actor", self.task.name, exc_info=True)
        ray.kill(self.actor, no_restart=True)

    def stop(self) -> None:
        try:  # not waited for: the task's exit tells the supervisor
            self.actor.stop.remote()
        except Exception:
            logger.debug("%s's actor could not be asked to stop", self.task.name, exc_info=True)

    def reap(self, timeout_s: float = 10.0) -> None:
        self._refresh(force=True)


class RayGroup:
    """The Ray launcher's `TaskGroup`: a placement group and one `TaskRunner` actor per task, per attempt."""

    def __init__(self, spec: WorkerSpec, config: PipelineConfig, env: Mapping[str, str] | None = None,
                 secret_env: Mapping[str, str] | None = None):
        self.spec_json = spec.model_dump_json()
        self.config = config
        self.extra_env = dict(env or {})
        # Literal secrets reach each worker process in its environment, handed to the actor with the call that
        # starts it (a task argument, kept in memory): not in runtime_env env_vars, which Ray's runtime env agent
        # writes to every node's runtime_env_agent.log ("Creating runtime env: ..."), nor in the actor's
        # constructor arguments, which the GCS keeps for restarts.
        self.secret_env = dict(secret_env or {})
        self.run_tag = f"tfdag-{uuid.uuid4().hex[:8]}"
        self.attempt = 0
        self.placement_group: Any = None
        self.actors: dict[str, tuple[Any, str, str]] = {}  # task name -> (actor, node ip, node id)
        self.started: list[RayTaskHandle] = []
        self.lost_nodes: set[str] = set()  # nodes on which an actor of this run was lost

    def capacity(self, wait_s: float) -> int:
        """Training workers the cluster's live nodes could hold (`ray_capacity.placeable_workers`; a node lost in this
        run whose raylet does not answer left out); waits up to `wait_s` for train.workers."""
        deadline = time.monotonic() + wait_s
        while True:
            nodes = [n for n in _alive_nodes() if n["NodeID"] not in self.lost_nodes or _raylet_answers(n)]
            placeable = placeable_workers(self.config, nodes)
            if placeable >= self.config.train.workers or time.monotonic() >= deadline:
                return placeable
            time.sleep(1.0)

    def plan_attempt(self, workers: int | None = None) -> list[TaskSpec]:
        ray = _ray()
        from ray.util.placement_group import placement_group, placement_group_table
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.end_attempt()
        self.attempt += 1
        layout = plan_tasks(self.config, workers=workers)
        ray_config = self.config.train.ray
        # Never on a node just lost: its raylet may be dead while the GCS still lists it alive.
        wait_until_lost_nodes_are_dead(self.lost_nodes, ray_config.placement_timeout_s)
        check_cluster(self.config, len(layout))
        bundle = dict(ray_config.resources_per_worker)
        strategy = "STRICT_SPREAD" if ray_config.placement == RayPlacement.SPREAD else "PACK"
        self.placement_group = placement_group([bundle] * len(layout), strategy=strategy,
                                               name=f"{self.run_tag}-attempt-{self.attempt}")
        try:
            ray.get(self.placement_group.ready(), timeout=ray_config.placement_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise LaunchError(
                f"Ray could not place {len(layout)} bundle(s) of {bundle} ({strategy}) within "
                f"train.ray.placement_timeout_s ({ray_config.placement_timeout_s:g} s); the cluster has "
                f"{len(_alive_nodes())} live node(s): free resources or add nodes") from None
        node_of_bundle = placement_group_table(self.placement_group)["bundles_to_node_id"]
        ip_of_node = {n["NodeID"]: n["NodeManagerAddress"] for n in _alive_nodes()}
        remote = ray.remote(TaskRunner)
        for index, task in enumerate(layout):
            node_id = node_of_bundle[index]
            actor = remote.options(
                **resource_options(bundle), runtime_env=ray_config.runtime_env or None, name=f"{self.run_tag}-{self.attempt}-{task.name}",
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement_group,
                                                                    placement_group_bundle_index=index),
            ).remote(self.spec_json, self.extra_env)
            self.actors[task.name] = (actor, ip_of_node.get(node_id, "?"), node_id)
        return self._with_node_addresses(layout)

    def _with_node_addresses(self, layout: list[TaskSpec]) -> list[TaskSpec]:
        """The layout's TF_CONFIG with each task at its node's IP and a port free on that node."""
        if not any(task.env_tf_config for task in layout):
            return layout
        ray = _ray()
        ports = ray.get([actor.free_port.remote(ip) for actor, ip, _ in self.actors.values()],
                        timeout=self.config.train.ray.placement_timeout_s)
        address = {name: f"{ip}:{port}" for (name, (_, ip, _)), port in zip(self.actors.items(), ports, strict=True)}
        jobs = collections.defaultdict(list)
        for task in layout:
            jobs[task.cluster.task_type].append(address[task.name])
        cluster = {job: tuple(addresses) for job, addresses in jobs.items()}
        return [TaskSpec(task.cluster.model_copy(update={"cluster": cluster}), is_trainer=task.is_trainer)
                for task in layout]

    def start(self, task: TaskSpec, log_fn: Callable[[str], None], log_lock: threading.Lock) -> RayTaskHandle:
        actor, node_ip, node_id = self.actors[task.name]
        handle = RayTaskHandle(task, actor, node_ip, node_id, log_fn, log_lock)
        self.started.append(handle)
        _ray().get(actor.start.remote(task.cluster.model_dump_json(), task.is_trainer, task.env_tf_config,
                                      self.secret_env),
                   timeout=self.config.train.ray.placement_timeout_s)
        return handle

    def end_attempt(self) -> None:
        """Kill every actor of the attempt (started or not) and remove its placement group."""
        ray = _ray()
        self.lost_nodes |= {handle.node_id for handle in self.started if handle.lost is not None}
        for actor, _, _ in self.actors.values():
            try:
                ray.kill(actor, no_restart=True)
            except Exception:
                logger.debug("ray.kill of an actor failed", exc_info=True)
        self.actors, self.started = {}, []
        if self.placement_group is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self.placement_group)
            finally:
                self.placement_group = None

    def close(self) -> None:
        self.end_attempt()


name = "ray"
config_model = RayConfig  # `train.ray`


def check_inputs(config: PipelineConfig, environ: Mapping[str, str] | None = None) -> None:
    """The Ray cluster's address is set (train.ray.address or RAY_ADDRESS); `connect` proves it answers.

    Raises:
        ConfigError: neither is set, naming both.
    """
    config.train.ray.resolved_address(dict(environ) if environ is not None else None)


def warm_up(config: PipelineConfig) -> None:
    """Nothing to start here: each task's actor starts its own worker process on its node."""


def launch_training(config: PipelineConfig, manifest: Manifest, plan: ShardPlan, run_dir: str, *,
                    options: LaunchOptions = DEFAULT_OPTIONS) -> TrainResult:
    """Train on the Ray cluster at train.ray.address (or RAY_ADDRESS): the train stage's entry point for Ray.

    This process connects as a Ray driver (it need not run inside the cluster) and supervises the tasks' actors
    to the end. `run_dir` and the dataset should be on an object store every node reaches: a local path is made
    absolute (an actor's working directory is not ours) and only works when every node shares it, as the nodes
    `tfdag stack up --ray N` starts on one host do.
    """
    if storage.is_local(run_dir) or storage.is_local(manifest.dataset_uri):
        logger.warning("train.launcher ray with a local run dir or dataset (%s, %s): every Ray node must see the "
                       "same path; use an object store (s3://, gs://) on a real cluster", run_dir,
                       manifest.dataset_uri)
    dataset_uri = storage.local_path(manifest.dataset_uri) if storage.is_local(manifest.dataset_uri) else \
        manifest.dataset_uri
    run_dir = storage.local_path(run_dir) if storage.is_local(run_dir) else run_dir
    # Resolved here, where the flow runs: a node has neither our working directory nor our MLFLOW_TRACKING_URI.
    output_root = storage.local_path(config.output_root) if storage.is_local(config.output_root) else \
        config.output_root
    config = config.model_copy(update={
        "output_root": output_root,
        "tracking": config.tracking.model_copy(update={"mlflow_uri": config.mlflow_uri})})
    values, secret_env = config.for_process()
    return launch_on_ray(
        WorkerSpec(config=values, dataset_uri=dataset_uri, plan=plan,
                   run_dir=run_dir, mlflow_run_id=options.mlflow_run_id, heartbeat_dir="<on each task's node>"),
        config, log_fn=options.log_fn, on_restart=options.on_restart, env=options.env, on_progress=options.on_progress,
        secret_env=secret_env, on_resize=options.on_resize).result


def launch_on_ray(spec: WorkerSpec, config: PipelineConfig, *, log_fn: Callable[[str], None] = print,
                  on_restart: Callable[[int, str], None] | None = None, env: Mapping[str, str] | None = None,
                  timeout_s: float | None = None,
                  on_progress: Callable[[TrainProgress], None] | None = None,
                  secret_env: Mapping[str, str] | None = None,
                  on_resize: Callable[[ResizeRecord], None] | None = None) -> LaunchResult:
    """`local.launch` with a `RayGroup`: connect, check the cluster, supervise, and always clean up.

    `secret_env` (from `PipelineConfig.for_process`) reaches every task's worker process in its environment.
    """
    connected = connect(config.train.ray)
    try:
        check_cluster(config, len(plan_tasks(config)))
        return launch(spec, config, log_fn=log_fn, timeout_s=timeout_s, on_restart=on_restart,
                      group=RayGroup(spec, config, env, secret_env), on_progress=on_progress, on_resize=on_resize)
    finally:
        if connected:
            _ray().shutdown()

