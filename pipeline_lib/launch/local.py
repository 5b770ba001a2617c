"""The local launcher: worker processes on 127.0.0.1, log streaming, and a supervisor with a hang watchdog.

`launch()` starts one `python -m pipeline_lib.launch.worker --spec ...` process per task (the same entry point as
`tfdag worker` in a pod) with a generated TF_CONFIG, streams their output with a `[worker 1]` prefix,
supervises them and returns the chief's TrainResult.

Supervision (like TFJob's ExitCode restart policy, plus a watchdog TFJob does not have):

- Exit classes: killed by a signal, 137, 143, 130 or `PREEMPTION_EXIT_CODE` → retryable; any other non-zero
  exit (1: a Python exception) → permanent: every process is ended at once and `WorkerFailed` names the task
  and the tail of its traceback.
- Watchdog: each training process writes a heartbeat (`<heartbeat_dir>/<task>.json`) as it steps. A task
  whose step has not advanced for `train.hang_timeout_s` gets the whole group fenced (every process killed:
  an all-reduce cannot go on without a peer) and restarted; training resumes from the last valid checkpoint.
  Startup (TensorFlow import, preflight, restore) is not counted against `hang_timeout_s`: until a task's
  first heartbeat it may be silent for `hang_timeout_s + STARTUP_ALLOWANCE_S`.
  `hang_timeout_s` must also exceed the longest checkpoint save with its evaluation (no heartbeat then).
- Restarts: at most `train.max_restarts`, after `restart_backoff_s`, doubling each time; each one recorded in
  `LaunchResult.restarts` and passed to `on_restart(n, cause)`. Then `RestartsExhausted` names the last cause.
- `train.timeout_s` (or the `timeout_s` argument) bounds the whole launch, restarts included: `LaunchTimeout`.

Every exit path (success, failure, timeout, Ctrl-C, SIGTERM to the launcher's main thread) kills each
worker's process group; workers also ask Linux to kill them if the launcher itself dies.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING

from pipeline_lib.cluster.validation import ClusterInfo
from pipeline_lib.config import PipelineConfig, Strategy
from pipeline_lib.core import storage
from pipeline_lib.core.errors import TfdagError
from pipeline_lib.launch.worker import (
    PARENT_PID_ENV,
    PREEMPTION_EXIT_CODE,
    RESULT_NAME,
    WorkerSpec,
    heartbeat_name,
    read_heartbeat,
)

if TYPE_CHECKING:  # training imports TensorFlow; the launcher process does not need it
    from pipeline_lib.data.manifest import Manifest
    from pipeline_lib.planning.sharding import ShardPlan
    from pipeline_lib.training.loop import TrainResult

logger = logging.getLogger(__name__)

STARTUP_ALLOWANCE_S = 120.0
RETRYABLE_EXIT_CODES = frozenset({130, 137, 143, PREEMPTION_EXIT_CODE})
POLL_S = 0.1
# After a preemption exit the others are finishing the same coordinated checkpoint: let them.
PREEMPTION_GRACE_S = 60.0
# After a permanent exit, a peer killed by a signal at about the same time is the likelier root cause.
PERMANENT_GRACE_S = 1.0
# After the chief succeeds, the other synchronous workers are only shutting down.
SHUTDOWN_GRACE_S = 30.0
TAIL_LINES = 300


class LaunchError(TfdagError, RuntimeError):
    """The launched training did not finish."""


class WorkerFailed(LaunchError):
    """A task failed permanently (a Python exception): no restart. Names the task and its traceback tail."""

    def __init__(self, message: str, task: str, exit_code: int, tail: str):
        super().__init__(message)
        self.task = task
        self.exit_code = exit_code
        self.tail = tail


class RestartsExhausted(LaunchError):
    """Retryable failures went on after train.max_restarts restarts; `cause` is the last one."""

    def __init__(self, message: str, cause: str):
        super().__init__(message)
        self.cause = cause


class LaunchTimeout(LaunchError):
    """train.timeout_s passed before training finished."""


@dataclasses.dataclass(frozen=True)
class RestartRecord:
    """One restart of the whole group: its number (1-based), why, and when (UNIX time)."""

    number: int
    cause: str
    time: float
    delay_s: float


@dataclasses.dataclass(frozen=True)
class LaunchResult:
    """The chief's TrainResult (with num_restarts filled in) and the supervisor's record."""

    result: "TrainResult"
    restarts: tuple[RestartRecord, ...]
    num_attempts: int
    wall_s: float


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """One process to start: its cluster value (TF_CONFIG) and whether the watchdog follows its heartbeat."""

    cluster: ClusterInfo
    is_trainer: bool
    env_tf_config: bool = True

    @property
    def name(self) -> str:
        return self.cluster.name


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct ports free on `host` right now (the OS picks them)."""
    sockets, ports = [], []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((host, 0))
            sockets.append(sock)
            ports.append(sock.getsockname()[1])
    finally:
        for sock in sockets:
            sock.close()
    return ports


def uses_parameter_server(config: PipelineConfig) -> bool:
    train = config.train
    return train.strategy == Strategy.PARAMETER_SERVER or (train.strategy == Strategy.AUTO and
                                                           train.parameter_servers > 0)


def plan_tasks(config: PipelineConfig, host: str = "127.0.0.1") -> list[TaskSpec]:
    """The processes of one attempt, each with a TF_CONFIG on fresh free ports.

    - one worker: a single process without TF_CONFIG (a single-worker strategy);
    - synchronous multi-worker: `worker 0..N-1`, worker 0 the chief;
    - parameter_server: `chief 0` (the coordinator, the only one that runs the loop), `worker 0..N-1` and
      `ps 0..M-1` (servers).
    """
    train = config.train
    if uses_parameter_server(config):
        ports = iter(free_ports(1 + train.workers + train.parameter_servers, host))
        cluster = {
            "chief": (f"{host}:{next(ports)}",),
            "worker": tuple(f"{host}:{next(ports)}" for _ in range(train.workers)),
            "ps": tuple(f"{host}:{next(ports)}" for _ in range(train.parameter_servers)),
        }
        tasks = [TaskSpec(ClusterInfo(task_type="chief", task_index=0, cluster=cluster), is_trainer=True)]
        tasks += [TaskSpec(ClusterInfo(task_type=job, task_index=i, cluster=cluster), is_trainer=False)
                  for job in ("worker", "ps") for i in range(len(cluster[job]))]
        return tasks
    if train.workers == 1:
        return [TaskSpec(ClusterInfo(), is_trainer=True, env_tf_config=False)]
    addresses = tuple(f"{host}:{port}" for port in free_ports(train.workers, host))
    return [TaskSpec(ClusterInfo(task_type="worker", task_index=i, cluster={"worker": addresses}), is_trainer=True)
            for i in range(train.workers)]


# What TensorFlow prints in a healthy worker whose peer died or stopped: a symptom, not that worker's bug.
PEER_FAILURE_MARKERS = (
    "Collective ops is aborted by",
    "tasks are unhealthy",
    "stopped sending heartbeats",
    "UnavailableError",
    "Socket closed",
    "Connection reset by peer",
    "failed to connect to all addresses",
)


def peer_failure_line(output: str) -> str | None:
    """The last output line that reports a lost or silent peer, or None when the failure is the task's own."""
    lines = [line.strip() for line in output.splitlines() if any(m in line for m in PEER_FAILURE_MARKERS)]
    return lines[-1][:300] if lines else None


def _is_stopped(pid: int) -> bool:
    """True when the process is stopped (SIGSTOP, state T in /proc/<pid>/stat)."""
    with open(f"/proc/{pid}/stat") as handle:
        return handle.read().rsplit(")", 1)[1].split()[0] in ("T", "t")


def _safe_is_stopped(pid: int) -> bool:
    try:
        return _is_stopped(pid)
    except (OSError, ValueError, IndexError):
        return False


def classify_exit(code: int) -> str:
    """'ok', 'retryable' or 'permanent' for a process's return code (negative: killed by that signal)."""
    if code == 0:
        return "ok"
    if code < 0 or code in RETRYABLE_EXIT_CODES:
        return "retryable"
    return "permanent"


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    if code == PREEMPTION_EXIT_CODE:
        return f"exited {code} (preempted: SIGTERM, checkpoint saved)"
    if code == 1:
        return "exited 1 (a Python exception)"
    return f"exited {code}"


class _Process:
    """One running task: the Popen, its log pump thread and the tail of its output."""

    def __init__(self, task: TaskSpec, popen: subprocess.Popen, log_fn: Callable[[str], None],
                 log_lock: threading.Lock):
        self.task = task
        self.popen = popen
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self._log_fn = log_fn
        self._log_lock = log_lock
        self.thread = threading.Thread(target=self._pump, name=f"tfdag-log-{task.name}", daemon=True)
        self.thread.start()

    def _pump(self) -> None:
        prefix = f"[{self.task.name}] "
        assert self.popen.stdout is not None
        for raw in iter(self.popen.stdout.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\n")
            self.tail.append(line)
            with self._log_lock:
                try:
                    self._log_fn(prefix + line)
                except Exception:  # a broken log sink must not stop the pump (or block the pipe)
                    logger.debug("log_fn failed on a line of %s", self.task.name, exc_info=True)
        self.popen.stdout.close()

    def poll(self) -> int | None:
        return self.popen.poll()

    def kill(self) -> None:
        # Its own session: the group id is its pid, and the kill reaches any child it started too
        # (also after the leader itself has exited).
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signal.SIGKILL)

    def reap(self, timeout_s: float = 10.0) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=timeout_s)
        self.thread.join(timeout=timeout_s)

    def traceback_tail(self, max_lines: int = 25) -> str:
        lines = list(self.tail)
        start = max((i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")),
                    default=max(0, len(lines) - max_lines))
        lines = lines[start:]
        if len(lines) > max_lines:
            lines = [lines[0], "  ..."] + lines[-(max_lines - 2):]
        return "\n".join(lines)


@dataclasses.dataclass
class _Outcome:
    kind: str  # "ok", "retryable", "permanent"
    cause: str = ""
    task: str = ""
    exit_code: int = 0
    tail: str = ""


class _Watch:
    """The watchdog's view of one training task's heartbeat."""

    def __init__(self, path: str, started: float):
        self.path = path
        self.last_step = -1
        self.last_progress = started
        self.has_beaten = False

    def update(self, now: float) -> None:
        beat = read_heartbeat(self.path)
        if beat is not None and int(beat.get("step", -1)) > self.last_step:
            self.last_step = int(beat["step"])
            self.last_progress = now
            self.has_beaten = True

    def silent_for(self, now: float) -> float:
        return now - self.last_progress


class _Supervisor:
    def __init__(self, spec: WorkerSpec, config: PipelineConfig, log_fn: Callable[[str], None],
                 env: Mapping[str, str] | None, deadline: float | None):
        self.spec = spec
        self.config = config
        self.log_fn = log_fn
        self.extra_env = dict(env or {})
        self.deadline = deadline
        self.log_lock = threading.Lock()
        self.processes: list[_Process] = []
        self._watches: dict[str, _Watch] = {}
        self.work_dir = tempfile.mkdtemp(prefix="tfdag-launch-")
        self.spec_path = os.path.join(self.work_dir, "worker_spec.json")
        with open(self.spec_path, "w") as handle:
            handle.write(spec.model_dump_json())

    # --- processes -------------------------------------------------------------------------------

    def _env(self, task: TaskSpec) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.extra_env)
        env.pop("TF_CONFIG", None)
        if task.env_tf_config:
            env["TF_CONFIG"] = task.cluster.to_tf_config()
        env["PYTHONUNBUFFERED"] = "1"
        env[PARENT_PID_ENV] = str(os.getpid())
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        return env

    def _start(self, tasks: list[TaskSpec]) -> None:
        command = [sys.executable, "-m", "pipeline_lib.launch.worker", "--spec", self.spec_path]
        for task in tasks:
            popen = subprocess.Popen(command, env=self._env(task), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, start_new_session=True)
            logger.debug("started %s as pid %d", task.name, popen.pid)
            self.processes.append(_Process(task, popen, self.log_fn, self.log_lock))

    def fence(self) -> None:
        """Kill every process of the group and wait for them (a no-op for those already gone)."""
        for process in self.processes:
            process.kill()
        for process in self.processes:
            process.reap()
        self.processes = []

    # --- one attempt -----------------------------------------------------------------------------

    def _reset_run_files(self) -> None:
        # Per attempt: an old result.json would pass for this attempt's, and the previous attempt's preflight
        # fingerprints would look like a second task claiming the same slot.
        shutil.rmtree(self.spec.heartbeat_dir, ignore_errors=True)
        os.makedirs(self.spec.heartbeat_dir, exist_ok=True)
        options = self.config.storage_options
        for name in (RESULT_NAME, "preflight"):
            fs, path = storage.get_fs(storage.join(self.spec.run_dir, name), options)
            if fs.exists(path):
                fs.rm(path, recursive=True)

    def run_attempt(self, number: int) -> _Outcome:
        self._reset_run_files()
        tasks = plan_tasks(self.config)
        self._start(tasks)
        started = time.monotonic()
        watches = {p.task.name: _Watch(os.path.join(self.spec.heartbeat_dir, heartbeat_name(p.task.cluster)), started)
                   for p in self.processes if p.task.is_trainer}
        self._watches = watches
        hang_timeout = self.config.train.hang_timeout_s
        chief = next(p for p in self.processes if p.task.cluster.is_chief)
        chief_done_at: float | None = None
        while True:
            now = time.monotonic()
            if self.deadline is not None and now > self.deadline:
                raise LaunchTimeout(
                    f"training did not finish within train.timeout_s ({self.config.train.timeout_s} s) in attempt "
                    f"{number}; every worker was stopped. Raise train.timeout_s or lower train.steps")
            codes = {p.task.name: p.poll() for p in self.processes}
            failed = self._first_failure(codes)
            if failed is not None:
                return failed
            if codes[chief.task.name] == 0:
                trainers_done = all(codes[p.task.name] == 0 for p in self.processes if p.task.is_trainer)
                chief_done_at = chief_done_at if chief_done_at is not None else now
                if trainers_done or now - chief_done_at > SHUTDOWN_GRACE_S:
                    if not trainers_done:
                        logger.warning("the chief finished but a worker is still running after %.0f s; ending it",
                                       SHUTDOWN_GRACE_S)
                    return _Outcome("ok", task=chief.task.name)
            for name, watch in watches.items():
                if codes[name] is not None:
                    continue
                watch.update(now)
                limit = hang_timeout if watch.has_beaten else hang_timeout + STARTUP_ALLOWANCE_S
                if watch.silent_for(now) > limit:
                    return self._hang(watches, codes, now)
            time.sleep(POLL_S)

    def _hang(self, watches: dict[str, _Watch], codes: dict[str, int | None], now: float) -> _Outcome:
        running = {n: w for n, w in watches.items() if codes[n] is None}
        # One silent peer stalls the whole all-reduce, so every task goes quiet at about the same time (and
        # heartbeats are throttled): a stopped process is the culprit when there is one, else the oldest beat.
        pids = {p.task.name: p.popen.pid for p in self.processes}
        stopped = [n for n in running if _safe_is_stopped(pids[n])]
        name = stopped[0] if stopped else min(running, key=lambda n: running[n].last_progress)
        watch = running[name]
        where = f"after step {watch.last_step}" if watch.has_beaten else "before its first step"
        state = " (stopped)" if stopped else ""
        cause = (f"hang: {name}{state} made no progress for {watch.silent_for(now):.1f} s {where} "
                 f"(train.hang_timeout_s {self.config.train.hang_timeout_s:g} s)")
        logger.warning("%s; fencing the group", cause)
        return _Outcome("retryable", cause=cause, task=name)

    def _first_failure(self, codes: dict[str, int | None]) -> _Outcome | None:
        failures = [(n, c) for n, c in codes.items() if c is not None and c != 0]
        if not failures:
            return None
        kinds = {n: classify_exit(c) for n, c in failures}
        if all(k == "permanent" for k in kinds.values()):
            # A peer killed by a signal makes the others fail with collective errors: wait a moment for it.
            until = time.monotonic() + PERMANENT_GRACE_S
            while time.monotonic() < until:
                later = {p.task.name: p.poll() for p in self.processes}
                if any(c is not None and classify_exit(c) == "retryable" for c in later.values()):
                    return self._first_failure(later)
                time.sleep(POLL_S)
            by_name = {p.task.name: p for p in self.processes}
            for name, _ in failures:
                by_name[name].reap(timeout_s=5.0)  # the pump thread has the last lines once the pipe closes
            own = [(n, c) for n, c in failures if peer_failure_line(by_name[n].traceback_tail()) is None]
            if own:
                name, code = own[0]
                return _Outcome("permanent", cause=f"{name} {describe_exit(code)}", task=name, exit_code=code,
                                tail=by_name[name].traceback_tail())
            # Every failure is TensorFlow reporting a lost or silent peer: retryable, and the cause is that peer.
            name, code = failures[0]
            return _Outcome("retryable", cause=self._lost_peer_cause(name, by_name[name].traceback_tail()),
                            task=name, exit_code=code)
        name, code = next((n, c) for n, c in failures if kinds[n] == "retryable")
        if code == PREEMPTION_EXIT_CODE:
            self._wait_for_peers(PREEMPTION_GRACE_S)
        return _Outcome("retryable", cause=f"{name} {describe_exit(code)}", task=name, exit_code=code)

    def _lost_peer_cause(self, failed: str, tail: str) -> str:
        line = peer_failure_line(tail) or "a peer failed"
        now = time.monotonic()
        for process in self.processes:
            if process.task.name == failed or process.poll() is not None:
                continue
            if _safe_is_stopped(process.popen.pid):
                watch = self._watches.get(process.task.name)
                where = f" after step {watch.last_step}" if watch is not None and watch.has_beaten else ""
                silent = f" for {watch.silent_for(now):.1f} s" if watch is not None else ""
                return (f"hang: {process.task.name} (stopped) made no progress{silent}{where}; "
                        f"{failed} aborted: {line}")
        return f"{failed} lost a peer: {line}"

    def _wait_for_peers(self, grace_s: float) -> None:
        """Let the other training tasks finish the coordinated preemption checkpoint and exit by themselves."""
        until = time.monotonic() + grace_s
        trainers = [p for p in self.processes if p.task.is_trainer]
        while time.monotonic() < until and any(p.poll() is None for p in trainers):
            time.sleep(POLL_S)

    def read_result(self) -> "TrainResult":
        from pipeline_lib.training.loop import TrainResult

        fs, path = storage.get_fs(storage.join(self.spec.run_dir, RESULT_NAME), self.config.storage_options)
        if not fs.exists(path):
            raise LaunchError(f"the chief exited 0 but wrote no {RESULT_NAME} in {self.spec.run_dir}; see its log")
        with fs.open(path, "rb") as handle:
            return TrainResult.model_validate_json(handle.read())

    def close(self) -> None:
        self.fence()
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
) -> LaunchResult:
    """Run the training cluster `config.train` describes as local processes and supervise it to the end.

    Args:
        spec: what every worker gets (config, dataset, plan, run_dir, MLflow run id, heartbeat_dir).
        config: the pipeline config (the `train` section sizes the cluster and the supervisor).
        log_fn: receives every output line of every task, prefixed `[worker 1] `; called from log threads
            one line at a time.
        timeout_s: the overall limit, restarts included; default `train.timeout_s` (None: no limit).
        on_restart: called as `on_restart(n, cause)` before restart n (1-based) starts.
        env: extra environment variables for the workers (e.g. TFDAG_FAULT in tests).

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
    supervisor = _Supervisor(spec, config, log_fn, env, deadline)
    attempt = 0
    try:
        with _sigterm_as_interrupt():
            while True:
                attempt += 1
                outcome = supervisor.run_attempt(attempt)
                if outcome.kind == "ok":
                    supervisor.fence()
                    result = supervisor.read_result().model_copy(update={"num_restarts": len(restarts)})
                    return LaunchResult(result=result, restarts=tuple(restarts), num_attempts=attempt,
                                        wall_s=time.monotonic() - started)
                supervisor.fence()
                if outcome.kind == "permanent":
                    raise WorkerFailed(
                        f"{outcome.cause}: a permanent failure, not restarted (attempt {attempt}). "
                        f"Its output ends with:\n{outcome.tail}",
                        task=outcome.task, exit_code=outcome.exit_code, tail=outcome.tail)
                if len(restarts) >= train.max_restarts:
                    raise RestartsExhausted(
                        f"training failed {attempt} time(s); train.max_restarts ({train.max_restarts}) is used up. "
                        f"Last cause: {outcome.cause}", cause=outcome.cause)
                delay = train.restart_backoff_s * (2 ** len(restarts))
                record = RestartRecord(number=len(restarts) + 1, cause=outcome.cause, time=time.time(), delay_s=delay)
                restarts.append(record)
                logger.warning("restart %d of %d in %.1f s: %s", record.number, train.max_restarts, delay,
                               outcome.cause)
                with supervisor.log_lock:
                    log_fn(f"[supervisor] restart {record.number}/{train.max_restarts} in {delay:.1f} s: "
                           f"{outcome.cause}")
                if on_restart is not None:
                    on_restart(record.number, outcome.cause)
                if deadline is not None and time.monotonic() + delay > deadline:
                    raise LaunchTimeout(
                        f"train.timeout_s ({limit} s) would pass during the restart backoff after: {outcome.cause}")
                time.sleep(delay)
    finally:
        supervisor.close()


def result_to_json(result: LaunchResult) -> str:
    """The LaunchResult as JSON (for artifacts and logs)."""
    return json.dumps({"result": result.result.model_dump(mode="json"),
                       "restarts": [dataclasses.asdict(r) for r in result.restarts],
                       "num_attempts": result.num_attempts, "wall_s": result.wall_s}, indent=2)


def launch_training(
    config: PipelineConfig,
    manifest: "Manifest",
    plan: "ShardPlan",
    run_dir: str,
    *,
    mlflow_run_id: str | None = None,
    log_fn: Callable[[str], None] = print,
    on_restart: Callable[[int, str], None] | None = None,
    env: Mapping[str, str] | None = None,
) -> "TrainResult":
    """Train `config` on `manifest` under `plan`: start the local cluster, supervise it, return the chief's result.

    The train stage's entry point: the same worker processes a cluster would run, one per task.
    """
    heartbeat_dir = tempfile.mkdtemp(prefix="tfdag-heartbeats-")
    spec = WorkerSpec(
        config=config.model_dump(mode="json"),
        dataset_uri=manifest.dataset_uri,
        plan=plan,
        run_dir=run_dir,
        mlflow_run_id=mlflow_run_id,
        heartbeat_dir=heartbeat_dir,
    )
    try:
        return launch(spec, config, log_fn=log_fn, on_restart=on_restart, env=env).result
    finally:
        shutil.rmtree(heartbeat_dir, ignore_errors=True)
