"""The local launcher: a training cluster as worker processes on 127.0.0.1, supervised and restarted.

`launch()` starts one `python -m pipeline_lib.launch.worker --spec ...` process per task (the same entry point as
`tfdag worker` in a pod) with a generated TF_CONFIG, streams their output with a `[worker 1]` prefix,
supervises them (`AttemptSupervisor`) and returns the chief's TrainResult.

Supervision (like TFJob's ExitCode restart policy, plus a watchdog TFJob does not have):

- Exit classes: killed by a signal, 137, 143, 130 or `PREEMPTION_EXIT_CODE` → retryable; any other non-zero
  exit (1: a Python exception) → permanent: every process is ended at once and `WorkerFailed` names the task
  and the tail of its traceback.
- Watchdog: a training task whose step has not advanced for `train.hang_timeout_s` gets the whole group fenced
  and restarted; training resumes from the last valid checkpoint (see `pipeline_lib.launch.supervisor`).
- Restarts: at most `train.max_restarts`, after `restart_backoff_s`, doubling each time. Each one is a
  `RestartRecord` with its cause and the step the restarted group resumed from (its chief's heartbeat says),
  logged as `[supervisor] restart N: ...`, passed to `on_restart(n, story)` once it resumed, and kept in
  `LaunchResult.restarts` and `TrainResult.restarts`. Then `RestartsExhausted` names the last cause.
- `train.timeout_s` (or the `timeout_s` argument) bounds the whole launch, restarts included: `LaunchTimeout`.

Every exit path (success, failure, timeout, Ctrl-C, SIGTERM to the launcher's main thread) kills each
worker's process group; workers also ask Linux to kill them if the launcher itself dies.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TypeVar

from pipeline_lib.cluster.info import ClusterInfo
from pipeline_lib.config import PipelineConfig
from pipeline_lib.core.net import LOOPBACK, free_ports
from pipeline_lib.data.manifest import Manifest
from pipeline_lib.launch.errors import (
    ElasticCapacityError,
    LaunchTimeout,
    RestartsExhausted,
    WorkerFailed,
    WorkerInputError,
)
from pipeline_lib.launch.exits import user_error_line
from pipeline_lib.launch.group import TaskGroup
from pipeline_lib.launch.processes import (
    TaskProcess,
    TaskSpec,
    start_worker,
    warm_fork_server,
)
from pipeline_lib.launch.protocol import DEFAULT_OPTIONS, LaunchOptions
from pipeline_lib.launch.spec import (
    USER_ERROR_EXIT_CODE,
    WorkerSpec,
    write_spec,
)
from pipeline_lib.launch.supervisor import AttemptSupervisor, TrainProgress
from pipeline_lib.planning.sharding import ShardPlan
from pipeline_lib.training.results import ResizeRecord, RestartRecord, TrainResult

logger = logging.getLogger(__name__)

RecordT = TypeVar("RecordT", RestartRecord, ResizeRecord)


@dataclasses.dataclass(frozen=True)
class LaunchResult:
    """The chief's TrainResult (with num_restarts filled in) and the supervisor's record."""

    result: TrainResult
    restarts: tuple[RestartRecord, ...]
    num_attempts: int
    wall_s: float
    resizes: tuple[ResizeRecord, ...] = ()


def plan_tasks(config: PipelineConfig, host: str = LOOPBACK, workers: int | None = None) -> list[TaskSpec]:
    """The processes of one attempt, each with a TF_CONFIG on fresh free ports; `workers` training workers (None:
    train.workers; an elastic run's resized attempt has fewer).

    - one worker: a single process without TF_CONFIG (a single-worker strategy);
    - synchronous multi-worker: `worker 0..N-1`, worker 0 the chief;
    - parameter_server: `chief 0` (the coordinator, the only one that runs the loop), `worker 0..N-1` and
      `ps 0..M-1` (servers).
    """
    train = config.train
    workers = workers if workers is not None else train.workers
    if train.uses_parameter_server():
        ports = iter(free_ports(1 + workers + train.parameter_servers, host))
        cluster = {
            "chief": (f"{host}:{next(ports)}",),
            "worker": tuple(f"{host}:{next(ports)}" for _ in range(workers)),
            "ps": tuple(f"{host}:{next(ports)}" for _ in range(train.parameter_servers)),
        }
        tasks = [TaskSpec(ClusterInfo(task_type="chief", task_index=0, cluster=cluster), is_trainer=True)]
        tasks += [TaskSpec(ClusterInfo(task_type=job, task_index=i, cluster=cluster), is_trainer=False)
                  for job in ("worker", "ps") for i in range(len(cluster[job]))]
        return tasks
    if train.workers == 1:
        return [TaskSpec(ClusterInfo(), is_trainer=True, env_tf_config=False)]
    addresses = tuple(f"{host}:{port}" for port in free_ports(workers, host))
    return [TaskSpec(ClusterInfo(task_type="worker", task_index=i, cluster={"worker": addresses}), is_trainer=True)
            for i in range(workers)]


def plan_attempt(spec: WorkerSpec, config: PipelineConfig, workers: int | None = None) -> list[TaskSpec]:
    """The tasks of the next local attempt, with an empty heartbeat directory: a previous attempt's heartbeat
    would pass for this one's progress."""
    shutil.rmtree(spec.heartbeat_dir, ignore_errors=True)
    os.makedirs(spec.heartbeat_dir, exist_ok=True)
    return plan_tasks(config, workers=workers)


class LocalGroup:
    """The local launcher's `TaskGroup`: each task a worker process on this machine, heartbeats in a local dir."""

    def __init__(self, spec: WorkerSpec, config: PipelineConfig, env: Mapping[str, str] | None = None):
        self.spec = spec
        self.config = config
        self.extra_env = dict(env or {})
        self.work_dir = tempfile.mkdtemp(prefix="tfdag-launch-")
        self.spec_path = write_spec(spec, self.work_dir)

    def plan_attempt(self, workers: int | None = None) -> list[TaskSpec]:
        return plan_attempt(self.spec, self.config, workers)

    def capacity(self, wait_s: float) -> int:
        """This machine places every worker: train.workers, at once (tests fake a node loss by replacing this:
        `pipeline_lib.testing.local_nodes`)."""
        return self.config.train.workers

    def start(self, task: TaskSpec, log_fn: Callable[[str], None], log_lock: threading.Lock) -> TaskProcess:
        return start_worker(task, self.spec_path, self.extra_env, log_fn, log_lock,
                            heartbeat_dir=self.spec.heartbeat_dir, fork=True)

    def end_attempt(self) -> None:
        pass

    def close(self) -> None:
        shutil.rmtree(self.work_dir, ignore_errors=True)


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """In the main thread, turn SIGTERM into KeyboardInterrupt so the finally blocks end the workers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handle(signum, frame):
        raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")

    previous = signal.signal(signal.SIGTERM, handle)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def launch(
    spec: WorkerSpec,
    config: PipelineConfig,
    *,
    log_fn: Callable[[str], None] = print,
    timeout_s: float | None = None,
    on_restart: Callable[[int, str], None] | None = None,
    env: Mapping[str, str] | None = None,
    group: TaskGroup | None = None,
    on_progress: Callable[[TrainProgress], None] | None = None,
    on_resize: Callable[[ResizeRecord], None] | None = None,
) -> LaunchResult:
    """Run the training cluster `config.train` describes and supervise it to the end.

    The restart loop every launcher shares: `group` places and starts the tasks (default `LocalGroup`, local
    processes; `ray_launcher.RayGroup` puts them on a Ray cluster), the `AttemptSupervisor` watches them.

    Args:
        spec: what every worker gets (config, dataset, plan, run_dir, MLflow run id, heartbeat_dir).
        config: the pipeline config (the `train` section sizes the cluster and the supervisor).
        log_fn: receives every output line of every task, prefixed `[worker 1] `; called from log threads
            one line at a time.
        timeout_s: the overall limit, restarts included; default `train.timeout_s` (None: no limit).
        on_restart: called as `on_restart(n, story)` for restart n (1-based) once the restarted group has
            restored (or failed before it did); the story is the cause and the step it resumed from.
        env: extra environment variables for the workers (e.g. a test's faults); for the default group.
        group: the task group; default `LocalGroup(spec, config, env)`.
        on_progress: called with the chief's progress (step of total, loss, examples/s) every few seconds.
        on_resize: an elastic run (`train.elastic`): called with each resize once the resized group restored.

    Elastic runs: after a retryable failure the next attempt runs on as many workers as the group can place
    within train.elastic.wait_s (`TaskGroup.capacity`), at least train.elastic.min_workers, at most train.workers;
    while it runs on fewer, the supervisor asks every few seconds whether more can be placed and, when so, stops
    the group at an agreed checkpoint and restarts it larger (a resize, not counted as a restart).

    Returns:
        The LaunchResult with the chief's TrainResult.

    Raises:
        WorkerFailed: a task failed permanently; the message names it and holds its traceback tail.
        RestartsExhausted: retryable failures outlasted train.max_restarts; names the last cause.
        LaunchTimeout: the overall timeout passed.
        KeyboardInterrupt: Ctrl-C (or SIGTERM to the launcher's main thread); every worker was ended first.
    """
    started = time.monotonic()
    train = config.train
    limit = timeout_s if timeout_s is not None else train.timeout_s
    deadline = started + limit if limit else None
    restarts: list[RestartRecord] = []
    resizes: list[ResizeRecord] = []
    supervisor = AttemptSupervisor(spec, config, group if group is not None else LocalGroup(spec, config, env),
                                   log_fn, deadline)
    supervisor.on_progress = on_progress
    elastic = train.elastic
    workers = train.workers
    if elastic is not None:
        def more_placeable() -> str | None:
            placeable = supervisor.group.capacity(0) if workers < train.workers else workers
            return f"{placeable} of {train.workers} workers can be placed again" if placeable > workers else None

        supervisor.stop_check = more_placeable
    told_restarts: set[int] = set()
    told_resizes: set[int] = set()

    def tell(resumed_step: int | None) -> None:
        """Complete the story of the latest restart and resize with where the group resumed, once each."""
        resize = _tell_latest(resizes, told_resizes, {"step": resumed_step}, supervisor, log_fn)
        if resize is not None and on_resize is not None:
            on_resize(resize)
        restart = _tell_latest(restarts, told_restarts, {"resumed_step": resumed_step}, supervisor, log_fn)
        if restart is not None and on_restart is not None:
            on_restart(restart.number, restart.story)

    attempt = 0
    try:
        with _sigterm_as_interrupt():
            while True:
                attempt += 1
                if supervisor.metrics is not None:
                    supervisor.metrics.workers.set(workers)
                tasks = (supervisor.group.plan_attempt(workers) if elastic is not None
                         else supervisor.group.plan_attempt())
                outcome = supervisor.run_attempt(attempt, tasks, on_resumed=tell)
                tell(None)  # a restarted group that ended before its chief restored
                if outcome.kind == "ok":
                    supervisor.fence()
                    result = supervisor.read_result().model_copy(
                        update={"num_restarts": len(restarts), "restarts": tuple(restarts),
                                "resizes": tuple(resizes)})
                    return LaunchResult(result=result, restarts=tuple(restarts), num_attempts=attempt,
                                        wall_s=time.monotonic() - started, resizes=tuple(resizes))
                supervisor.fence()
                if outcome.kind == "permanent":
                    bad_input = user_error_line(outcome.tail) if outcome.exit_code == USER_ERROR_EXIT_CODE else None
                    if bad_input is not None:
                        raise WorkerInputError(f"{outcome.task}: {bad_input}", task=outcome.task,
                                               exit_code=outcome.exit_code, tail=outcome.tail)
                    raise WorkerFailed(
                        f"{outcome.cause}: a permanent failure, not restarted (attempt {attempt}). "
                        f"Its output ends with:\n{outcome.tail}",
                        task=outcome.task, exit_code=outcome.exit_code, tail=outcome.tail)
                if supervisor.stopped_for is not None:  # stopped to grow: a resize, not a restart
                    workers = _resize(supervisor, resizes, workers, supervisor.stopped_for, 0.0, log_fn)
                    continue
                if len(restarts) >= train.max_restarts:
                    raise RestartsExhausted(
                        f"training failed {attempt} time(s); train.max_restarts ({train.max_restarts}) is used up. "
                        f"Last cause: {outcome.cause}", cause=outcome.cause)
                delay = train.restart_backoff_s * (2 ** len(restarts))
                record = RestartRecord(number=len(restarts) + 1, cause=outcome.cause, time=time.time(), delay_s=delay,
                                       total_steps=spec.plan.total_steps)
                restarts.append(record)
                if supervisor.metrics is not None:
                    supervisor.metrics.restarts.inc()
                logger.warning("restart %d of %d in %.1f s: %s", record.number, train.max_restarts, delay,
                               outcome.cause)
                with supervisor.log_lock:
                    log_fn(f"[supervisor] restart {record.number}/{train.max_restarts} in {delay:.1f} s: "
                           f"{outcome.cause}")
                if deadline is not None and time.monotonic() + delay > deadline:
                    raise LaunchTimeout(
                        f"train.timeout_s ({limit} s) would pass during the restart backoff after: {outcome.cause}")
                if elastic is not None:
                    workers = _resize(supervisor, resizes, workers, outcome.cause, elastic.wait_s, log_fn)
                time.sleep(delay)
    finally:
        supervisor.close()


def _tell_latest(records: list[RecordT], told: set[int], update: dict, supervisor: AttemptSupervisor,
                 log_fn: Callable[[str], None]) -> RecordT | None:
    """Complete the latest of `records` (restarts or resizes) with `update` and tell it, once: a warning and a
    `[supervisor]` line. Returns the completed record when it was told now (for the caller's callback), else None."""
    if not records or records[-1].number in told:
        return None
    record = records[-1] = records[-1].model_copy(update=update)
    told.add(record.number)
    logger.warning("%s", record.describe())
    with supervisor.log_lock:
        log_fn(f"[supervisor] {record.describe()}")
    return record


def _resize(supervisor: AttemptSupervisor, resizes: list[ResizeRecord], workers: int, cause: str, wait_s: float,
            log_fn: Callable[[str], None]) -> int:
    """An elastic run's worker count for its next attempt: what the group can place within `wait_s`, at least
    train.elastic.min_workers (else `ElasticCapacityError`); a change is appended to `resizes` (its step is told
    once the resized group restored)."""
    train = supervisor.config.train
    placeable = supervisor.group.capacity(wait_s)
    if train.elastic_workers_problem(placeable) is not None:
        raise ElasticCapacityError(
            f"{cause}; only {placeable} of train.workers ({train.workers}) workers could be placed within "
            f"train.elastic.wait_s ({train.elastic.wait_s:g} s), fewer than train.elastic.min_workers "
            f"({train.elastic.min_workers}): add capacity (nodes with the workers' resources), lower "
            "train.elastic.min_workers, or raise train.elastic.wait_s", cause=cause)
    if placeable == workers:
        return workers
    reason = cause if placeable > workers else (
        f"{cause}; {placeable} of {train.workers} workers could be placed within train.elastic.wait_s "
        f"({train.elastic.wait_s:g} s)")
    record = ResizeRecord(number=len(resizes) + 1, from_workers=workers, to_workers=placeable, reason=reason,
                          time=time.time())
    resizes.append(record)
    logger.warning("resizing the group from %d to %d workers: %s", workers, placeable, reason)
    with supervisor.log_lock:
        log_fn(f"[supervisor] resizing the group from {workers} to {placeable} workers: {reason}")
    return placeable


name = "local"
config_model = None  # no settings of its own: `train` sizes the cluster and the supervisor


def check_inputs(config: PipelineConfig, environ: Mapping[str, str] | None = None) -> None:
    """Nothing beyond what every launch checks: the local cluster is started by the launch itself."""


def warm_up(config: PipelineConfig) -> None:
    """Start this process's fork server for the workers of `config` on a background thread (its TensorFlow import
    overlaps the stages before training); a failure there is left to the launch, which starts workers without it."""
    threading.Thread(target=warm_fork_server, args=(config.for_process()[1],), name="tfdag-warm-up",
                     daemon=True).start()


def launch_training(config: PipelineConfig, manifest: Manifest, plan: ShardPlan, run_dir: str, *,
                    options: LaunchOptions = DEFAULT_OPTIONS,
                    make_group: Callable[[WorkerSpec], TaskGroup] | None = None) -> TrainResult:
    """Train `config` on `manifest` under `plan`: start the local cluster, supervise it, return the chief's result.

    The local `Launcher.launch_training`: the same worker processes a cluster would run, one per task;
    `make_group` replaces them (`launch.in_process` passes its one-thread group).
    """
    heartbeat_dir = tempfile.mkdtemp(prefix="tfdag-heartbeats-")
    values, secret_env = config.for_process()
    spec = WorkerSpec(
        config=values,
        dataset_uri=manifest.dataset_uri,
        plan=plan,
        run_dir=run_dir,
        mlflow_run_id=options.mlflow_run_id,
        heartbeat_dir=heartbeat_dir,
    )
    group = make_group(spec) if make_group is not None else None
    try:
        # A literal secret of the config reaches the workers in their environment, never in the spec file.
        return launch(spec, config, log_fn=options.log_fn, on_restart=options.on_restart,
                      env={**secret_env, **(options.env or {})}, on_progress=options.on_progress, group=group,
                      on_resize=options.on_resize).result
    finally:
        shutil.rmtree(heartbeat_dir, ignore_errors=True)
