"""The supervisor of one launch: runs each attempt's tasks, classifies their exits, and a hang watchdog.

It sees tasks through the `launch.group` protocol, so the local launcher and the Ray launcher share it whole.
Each training process writes a heartbeat (its launcher reads it: a local file, or through its Ray actor) with its
step and its phase
(`training.hooks.Phase`). A task whose heartbeat has not changed (a new step or a new phase) for its phase's
bound (`phase_bound_s`) gets the whole group fenced (every process killed: an all-reduce cannot go on without a
peer) and the attempt ends retryable. The bounds, from `train.hang_timeout_s` (H):

- starting (import, preflight, restore): H + STARTUP_ALLOWANCE_S;
- stepping: H;
- saving (a checkpoint with its evaluation) and finishing (the final save, the result, the collective shutdown):
  SLOW_PHASE_FACTOR × H, because each is a whole save and evaluation without a step in between, slowest on a
  loaded machine, and a finished run must never be fenced for being slow.

A task blocked in a collective waits for its slowest peer (the others' next step waits on the chief's save), so
the bound that applies is the largest over the group's running tasks, and it is the group's silence that counts:
a fence needs every running task silent for longer than that bound (a worker that entered a step while its peer
was saving has been silent since before the save, yet the peer's progress shows the group is alive).

Every line of every task is also kept in `<run_dir>/logs/<task>.log` (all attempts); with
`observability.prometheus_port` the supervisor serves its own metrics and keeps `<run_dir>/prometheus_targets.json`
listing every task endpoint its heartbeats announce (emptied at the end).

Once the chief has exited 0 (its result is written) nothing is fenced: the others get the finishing bound (at
most SHUTDOWN_GRACE_S) to exit, then are ended.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from pipeline_lib.cluster.address import validate_cluster_addresses
from pipeline_lib.config import PipelineConfig
from pipeline_lib.core import storage
from pipeline_lib.core.events import TrainProgress
from pipeline_lib.launch.errors import LaunchError, LaunchTimeout
from pipeline_lib.launch.exits import classify_exit, peer_failure_line
from pipeline_lib.launch.group import TaskGroup, TaskHandle
from pipeline_lib.launch.heartbeat import read_heartbeat
from pipeline_lib.launch.processes import TaskSpec
from pipeline_lib.launch.prometheus import TARGETS_NAME, SupervisorMetrics
from pipeline_lib.launch.spec import PREEMPTION_EXIT_CODE, RESULT_NAME, WorkerSpec
from pipeline_lib.training.hooks import Phase
from pipeline_lib.training.results import TrainResult

logger = logging.getLogger(__name__)

STARTUP_ALLOWANCE_S = 120.0
SLOW_PHASE_FACTOR = 3.0
POLL_S = 0.1
# After a preemption exit the others are finishing the same coordinated checkpoint: let them.
PREEMPTION_GRACE_S = 60.0
# After a permanent exit, a peer killed by a signal at about the same time is the likelier root cause.
PERMANENT_GRACE_S = 1.0
# After the chief succeeds, the other synchronous workers are only shutting down.
SHUTDOWN_GRACE_S = 30.0
PROGRESS_INTERVAL_S = 2.0
STOP_CHECK_S = 3.0  # how often an elastic run running on fewer workers asks whether more can be placed
LOGS_NAME = "logs"  # <run_dir>/logs/<task>.log: every line of every task, all attempts


@dataclasses.dataclass
class AttemptOutcome:
    """How one attempt ended: 'ok', 'retryable' or 'permanent', why, which task, its exit code and output tail."""

    kind: str
    cause: str = ""
    task: str = ""
    exit_code: int = 0
    tail: str = ""


def phase_bound_s(phase: Phase, hang_timeout_s: float) -> float:
    """How long a task may go without a new step or phase in `phase` before it counts as hung (see above)."""
    if phase == Phase.STARTING:
        return hang_timeout_s + STARTUP_ALLOWANCE_S
    if phase == Phase.STEPPING:
        return hang_timeout_s
    return SLOW_PHASE_FACTOR * hang_timeout_s


def describe_bound(phase: Phase, hang_timeout_s: float) -> str:
    """The bound of `phase` with the rule it comes from, for a hang's cause."""
    bound = phase_bound_s(phase, hang_timeout_s)
    if phase == Phase.STARTING:
        rule = f"train.hang_timeout_s {hang_timeout_s:g} s + {STARTUP_ALLOWANCE_S:g} s startup allowance"
    elif phase == Phase.STEPPING:
        return f"train.hang_timeout_s {hang_timeout_s:g} s"
    else:
        rule = f"{SLOW_PHASE_FACTOR:g} × train.hang_timeout_s {hang_timeout_s:g} s"
    return f"{bound:g} s = {rule}"


def group_bound_s(watches: list[HeartbeatWatch], hang_timeout_s: float) -> float:
    """The silence a running group allows: the largest bound of its tasks' phases (see above)."""
    return max(phase_bound_s(w.phase, hang_timeout_s) for w in watches)


class HeartbeatWatch:
    """The watchdog's view of one training task's heartbeat: its step, phase, and when either last changed.

    Before the first heartbeat the task counts as starting. A heartbeat without a phase counts as stepping.
    `source` is the heartbeat file's path or a function that returns the latest heartbeat (a task handle's).
    """

    def __init__(self, source: str | Callable[[], dict[str, Any] | None], started: float):
        self._read = source if callable(source) else (lambda: read_heartbeat(source))
        self.last_step = -1
        self.phase = Phase.STARTING
        self.start_step: int | None = None
        self.last_progress = started
        self.has_beaten = False
        self.beat: dict[str, Any] = {}  # the latest heartbeat read
        self._key: tuple | None = None

    def update(self, now: float) -> None:
        beat = self._read()
        if beat is None:
            return
        self.beat = beat
        try:
            phase = Phase(beat.get("phase", Phase.STEPPING.value))
            step = int(beat.get("step", -1))
            start_step = beat.get("start_step")
        except (TypeError, ValueError):
            return
        key = (phase, step, start_step)
        if key != self._key:
            self._key = key
            self.phase, self.last_step, self.last_progress, self.has_beaten = phase, step, now, True
            self.start_step = int(start_step) if start_step is not None else None

    def silent_for(self, now: float) -> float:
        return now - self.last_progress

    def overdue_s(self, now: float, hang_timeout_s: float) -> float:
        """How far past its phase's bound the task is (negative: within it)."""
        return self.silent_for(now) - phase_bound_s(self.phase, hang_timeout_s)


class AttemptSupervisor:
    """Runs attempts of one launch's task group until each ends (ok, retryable, permanent) and fences them."""

    def __init__(self, spec: WorkerSpec, config: PipelineConfig, group: TaskGroup, log_fn: Callable[[str], None],
                 deadline: float | None):
        self.spec = spec
        self.config = config
        self.group = group
        self.log_fn = log_fn
        self.deadline = deadline
        self.log_lock = threading.Lock()
        self.processes: list[TaskHandle] = []
        self._watches: dict[str, HeartbeatWatch] = {}
        self.logs_dir = tempfile.mkdtemp(prefix="tfdag-task-logs-")  # copied to <run_dir>/logs at the end
        # Called with the chief's progress at most every PROGRESS_INTERVAL_S (from the supervising thread).
        self.on_progress: Callable[[TrainProgress], None] | None = None
        self._progress_seen: tuple[float, int, int] | None = None  # (time, step, examples) of the last report
        # An elastic run's question, asked every STOP_CHECK_S while the chief steps: a reason to stop the group at an
        # agreed checkpoint (to restart it larger), or None. `stopped_for` is the reason of the attempt it stopped.
        self.stop_check: Callable[[], str | None] | None = None
        self.stopped_for: str | None = None
        self.metrics: SupervisorMetrics | None = None
        if config.observability.prometheus_port is not None:
            self.metrics = SupervisorMetrics(os.path.basename(spec.run_dir.rstrip("/")), "127.0.0.1",
                                             config.observability.prometheus_port,
                                             storage.join(spec.run_dir, TARGETS_NAME), config.storage_options)

    def fence(self) -> None:
        """Kill every task of the group, wait for them, and release the attempt's placement (idempotent)."""
        try:
            for process in self.processes:
                process.kill()
            for process in self.processes:
                process.reap()
            self.processes = []
        finally:
            self.group.end_attempt()

    def _reset_run_files(self) -> None:
        # Per attempt: an old result.json would pass for this attempt's, and the previous attempt's preflight
        # fingerprints would look like a second task claiming the same slot.
        options = self.config.storage_options
        for name in (RESULT_NAME, "preflight"):
            fs, path = storage.get_fs(storage.join(self.spec.run_dir, name), options)
            if fs.exists(path):
                fs.rm(path, recursive=True)

    def run_attempt(self, number: int, tasks: list[TaskSpec],
                    on_resumed: Callable[[int], None] | None = None) -> AttemptOutcome:
        """Start `tasks` and watch them until the attempt ends; the processes are left for `fence`.

        `on_resumed(step)` is called once, when the chief reports the step it restored (0: a fresh start).

        Raises:
            LaunchTimeout: the launch's deadline passed during the attempt.
        """
        # Launcher-made addresses pass the same rule as a user's TF_CONFIG (cluster/address.py), before any start.
        validate_cluster_addresses(dict(tasks[0].cluster.cluster), "the cluster spec the launcher generated")
        self._reset_run_files()
        for task in tasks:  # one by one: if a start fails, `fence` still ends those already started
            self.processes.append(self.group.start(task, self._kept(task, number), self.log_lock))
        started = time.monotonic()
        watches = {p.task.name: HeartbeatWatch(p.read_heartbeat, started) for p in self.processes if p.task.is_trainer}
        self._watches = watches
        hang_timeout = self.config.train.hang_timeout_s
        chief = next(p for p in self.processes if p.task.cluster.is_chief)
        chief_watch = watches[chief.task.name]
        shutdown_grace = min(SHUTDOWN_GRACE_S, phase_bound_s(Phase.FINISHING, hang_timeout))
        chief_done_at: float | None = None
        resumed_reported = False
        self.stopped_for = None
        checked_at = started
        while True:
            now = time.monotonic()
            if self.deadline is not None and now > self.deadline:
                raise LaunchTimeout(
                    f"training did not finish within train.timeout_s ({self.config.train.timeout_s} s) in attempt "
                    f"{number}; every worker was stopped. Raise train.timeout_s or lower train.steps")
            codes = {p.task.name: p.poll() for p in self.processes}
            # Read the heartbeats before judging the exits: a chief that restored a checkpoint and died before the
            # next poll has still resumed, and its restart story must say from where.
            running = [w for n, w in watches.items() if codes[n] is None]
            for watch in {*running, chief_watch}:
                watch.update(now)
            if not resumed_reported and chief_watch.start_step is not None:
                resumed_reported = True
                if on_resumed is not None:
                    on_resumed(chief_watch.start_step)
            failed = self._first_failure(codes)
            if failed is not None:
                return failed
            if codes[chief.task.name] == 0:
                trainers_done = all(codes[p.task.name] == 0 for p in self.processes if p.task.is_trainer)
                chief_done_at = chief_done_at if chief_done_at is not None else now
                if trainers_done or now - chief_done_at > shutdown_grace:
                    if not trainers_done:
                        logger.warning("the chief finished but a worker is still running after %.0f s; ending it",
                                       shutdown_grace)
                    return AttemptOutcome("ok", task=chief.task.name)
                # The result is written: a worker slow or stuck in its shutdown cannot lose the run.
                time.sleep(POLL_S)
                continue
            if self.metrics is not None:
                self._publish_metrics(watches)
            if self.on_progress is not None:
                self._report_progress(chief_watch)
            if (self.stop_check is not None and self.stopped_for is None and chief_watch.phase == Phase.STEPPING
                    and now - checked_at >= STOP_CHECK_S):
                checked_at = now
                self._stop_if(self.stop_check())
            # The group, not one task, must have been silent past the bound: a worker that stepped into a collective
            # while its peer was still saving has been "silent" since before that save, but the peer's progress
            # shows the group is alive (a synchronous step cannot complete while any task of it hangs).
            if running and min(w.silent_for(now) for w in running) > group_bound_s(running, hang_timeout):
                return self._hang(watches, codes, now)
            time.sleep(POLL_S)

    def _stop_if(self, reason: str | None) -> None:
        """Ask the training tasks to stop at an agreed checkpoint (the preemption path) when there is a reason."""
        if not reason:
            return
        self.stopped_for = reason
        logger.warning("%s: stopping the group at an agreed checkpoint to restart it", reason)
        with self.log_lock:
            self.log_fn(f"[supervisor] {reason}: stopping the group at an agreed checkpoint to restart it")
        # Only the tasks that run the loop can agree on a checkpoint; a parameter-server run's servers end on SIGTERM
        # (143) before the chief saves, so they are left to the fence once the chief has left.
        for process in self.processes:
            if process.task.is_trainer:
                process.stop()

    def _kept(self, task: TaskSpec, attempt: int) -> Callable[[str], None]:
        """The task's log function: each line to `log_fn` and appended to the task's log file."""
        path = os.path.join(self.logs_dir, f"{task.name.replace(' ', '-')}.log")
        with open(path, "a", encoding="utf-8") as handle:
            handle.write(f"--- attempt {attempt} ---\n")

        def log(line: str) -> None:
            with open(path, "a", encoding="utf-8") as handle:
                handle.write(line + "\n")
            self.log_fn(line)

        return log

    def _report_progress(self, chief_watch: HeartbeatWatch) -> None:
        now = time.monotonic()
        if self._progress_seen is not None and now - self._progress_seen[0] < PROGRESS_INTERVAL_S:
            return
        beat = chief_watch.beat
        step, examples = int(beat.get("step", 0) or 0), int(beat.get("examples", 0) or 0)
        rate = step_rate = None
        if self._progress_seen is not None and examples >= self._progress_seen[2]:
            rate = (examples - self._progress_seen[2]) / (now - self._progress_seen[0])
        if self._progress_seen is not None and step >= self._progress_seen[1]:
            step_rate = (step - self._progress_seen[1]) / (now - self._progress_seen[0])
        self._progress_seen = (now, step, examples)
        try:
            assert self.on_progress is not None
            self.on_progress(TrainProgress(step=max(step, 0), total_steps=self.spec.plan.total_steps,
                                           loss=beat.get("loss"), examples_per_second=rate,
                                           steps_per_second=step_rate, eval_metrics=dict(beat.get("eval") or {})))
        except Exception:  # a progress display must not stop training
            logger.debug("progress callback failed", exc_info=True)

    def _publish_metrics(self, watches: dict[str, HeartbeatWatch]) -> None:
        """The straggler signal from the heartbeats, and the targets file with every task endpoint announced."""
        assert self.metrics is not None
        steps = {}
        for process in self.processes:
            watch = watches.get(process.task.name)
            if watch is not None and watch.last_step >= 0:
                steps[(process.task.cluster.task_type, process.task.cluster.task_index)] = watch.last_step
        self.metrics.set_lag(steps)
        self.metrics.write_targets([w.beat["metrics"] for w in watches.values()
                                    if isinstance(w.beat.get("metrics"), dict)])

    def _hang(self, watches: dict[str, HeartbeatWatch], codes: dict[str, int | None], now: float) -> AttemptOutcome:
        running = {n: w for n, w in watches.items() if codes[n] is None}
        # One silent peer stalls the whole all-reduce, so every task goes quiet at about the same time (and
        # heartbeats are throttled): a stopped process is the culprit when there is one, else the most overdue.
        by_name = {p.task.name: p for p in self.processes}
        stopped = [n for n in running if by_name[n].is_stopped()]
        hang_timeout = self.config.train.hang_timeout_s
        name = stopped[0] if stopped else max(running, key=lambda n: running[n].overdue_s(now, hang_timeout))
        watch = running[name]
        where = "before its first step" if watch.phase == Phase.STARTING else f"after step {watch.last_step}"
        state = " (stopped)" if stopped else ""
        slowest = max(running.values(), key=lambda w: phase_bound_s(w.phase, hang_timeout)).phase
        cause = (f"hang: {name}{state} made no progress for {watch.silent_for(now):.1f} s {where}, "
                 f"{watch.phase.value} (bound {describe_bound(slowest, hang_timeout)}"
                 f"{'' if slowest == watch.phase else f' while a peer was {slowest.value}'})")
        logger.warning("%s; fencing the group", cause)
        return AttemptOutcome("retryable", cause=cause, task=name)

    def _first_failure(self, codes: dict[str, int | None]) -> AttemptOutcome | None:
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
                return AttemptOutcome("permanent", cause=f"{name} {by_name[name].describe_exit(code)}", task=name,
                                      exit_code=code,
                                      tail=by_name[name].traceback_tail())
            # Every failure is TensorFlow reporting a lost or silent peer: retryable, and the cause is that peer.
            name, code = failures[0]
            return AttemptOutcome("retryable", cause=self._lost_peer_cause(name, by_name[name].traceback_tail()),
                                  task=name, exit_code=code)
        name, code = next((n, c) for n, c in failures if kinds[n] == "retryable")
        if code == PREEMPTION_EXIT_CODE:
            self._wait_for_peers(PREEMPTION_GRACE_S)
            # Every task exits 138 after the coordinated checkpoint, in whatever order: name the first in task
            # order (the chief first), not whichever exit the poll happened to see first.
            later = {p.task.name: p.poll() for p in self.processes}
            name = next((n for n, c in later.items() if c == PREEMPTION_EXIT_CODE), name)
            code = later.get(name, code) or code
        by_name = {p.task.name: p for p in self.processes}
        return AttemptOutcome("retryable", cause=f"{name} {by_name[name].describe_exit(code)}", task=name,
                              exit_code=code)

    def _lost_peer_cause(self, failed: str, tail: str) -> str:
        line = peer_failure_line(tail) or "a peer failed"
        now = time.monotonic()
        for process in self.processes:
            if process.task.name == failed or process.poll() is not None:
                continue
            if process.is_stopped():
                watch = self._watches.get(process.task.name)
                where = (f" after step {watch.last_step}" if watch is not None and watch.phase != Phase.STARTING
                         else "")
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

    def read_result(self) -> TrainResult:
        """The chief's TrainResult of the attempt that ended ok.

        Raises:
            LaunchError: the chief exited 0 without writing it.
        """
        fs, path = storage.get_fs(storage.join(self.spec.run_dir, RESULT_NAME), self.config.storage_options)
        if not fs.exists(path):
            raise LaunchError(f"the chief exited 0 but wrote no {RESULT_NAME} in {self.spec.run_dir}; see its log")
        with fs.open(path, "rb") as handle:
            return TrainResult.model_validate_json(handle.read())

    def close(self) -> None:
        """End every task and release the group; keep the task logs in `<run_dir>/logs/` (whatever the outcome);
        empty the Prometheus targets."""
        try:
            self.fence()
        finally:
            try:
                self.group.close()
            finally:
                if self.metrics is not None:
                    self.metrics.close()
                self._keep_logs()

    def _keep_logs(self) -> None:
        try:
            fs, path = storage.get_fs(storage.join(self.spec.run_dir, LOGS_NAME), self.config.storage_options)
            storage.upload_tree(self.logs_dir, fs, path)
        except Exception as error:  # noqa: BLE001 - losing the log copy must not hide how training ended
            logger.warning("task logs not copied to %s/%s: %s", self.spec.run_dir, LOGS_NAME, error)
        shutil.rmtree(self.logs_dir, ignore_errors=True)
