"""The supervisor of one launch: runs each attempt's processes, classifies their exits, and a hang watchdog.

Each training process writes a heartbeat (`<heartbeat_dir>/<task>.json`) as it steps. A task whose step has not
advanced for `train.hang_timeout_s` gets the whole group fenced (every process killed: an all-reduce cannot go on
without a peer) and the attempt ends retryable. Startup (TensorFlow import, preflight, restore) is not counted
against `hang_timeout_s`: until a task's first heartbeat it may be silent for `hang_timeout_s + STARTUP_ALLOWANCE_S`.
`hang_timeout_s` must also exceed the longest checkpoint save with its evaluation (no heartbeat then).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Mapping

from pipeline_lib.config import PipelineConfig
from pipeline_lib.core import storage
from pipeline_lib.launch.errors import LaunchError, LaunchTimeout
from pipeline_lib.launch.exits import classify_exit, describe_exit, peer_failure_line
from pipeline_lib.launch.heartbeat import heartbeat_name, read_heartbeat
from pipeline_lib.launch.processes import (
    TaskProcess,
    TaskSpec,
    is_stopped,
    start_worker,
)
from pipeline_lib.launch.spec import PREEMPTION_EXIT_CODE, RESULT_NAME, WorkerSpec
from pipeline_lib.training.results import TrainResult

logger = logging.getLogger(__name__)

STARTUP_ALLOWANCE_S = 120.0
POLL_S = 0.1
# After a preemption exit the others are finishing the same coordinated checkpoint: let them.
PREEMPTION_GRACE_S = 60.0
# After a permanent exit, a peer killed by a signal at about the same time is the likelier root cause.
PERMANENT_GRACE_S = 1.0
# After the chief succeeds, the other synchronous workers are only shutting down.
SHUTDOWN_GRACE_S = 30.0


@dataclasses.dataclass
class AttemptOutcome:
    """How one attempt ended: 'ok', 'retryable' or 'permanent', why, which task, its exit code and output tail."""

    kind: str
    cause: str = ""
    task: str = ""
    exit_code: int = 0
    tail: str = ""


class HeartbeatWatch:
    """The watchdog's view of one training task's heartbeat: its last step and when that step advanced."""

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


class AttemptSupervisor:
    """Runs attempts of one launch's process group until each ends (ok, retryable, permanent) and fences them."""

    def __init__(self, spec: WorkerSpec, config: PipelineConfig, log_fn: Callable[[str], None],
                 env: Mapping[str, str] | None, deadline: float | None):
        self.spec = spec
        self.config = config
        self.log_fn = log_fn
        self.extra_env = dict(env or {})
        self.deadline = deadline
        self.log_lock = threading.Lock()
        self.processes: list[TaskProcess] = []
        self._watches: dict[str, HeartbeatWatch] = {}
        self.work_dir = tempfile.mkdtemp(prefix="tfdag-launch-")
        self.spec_path = os.path.join(self.work_dir, "worker_spec.json")
        with open(self.spec_path, "w") as handle:
            handle.write(spec.model_dump_json())

    def fence(self) -> None:
        """Kill every process of the group and wait for them (a no-op for those already gone)."""
        for process in self.processes:
            process.kill()
        for process in self.processes:
            process.reap()
        self.processes = []

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

    def run_attempt(self, number: int, tasks: list[TaskSpec]) -> AttemptOutcome:
        """Start `tasks` and watch them until the attempt ends; the processes are left for `fence`.

        Raises:
            LaunchTimeout: the launch's deadline passed during the attempt.
        """
        self._reset_run_files()
        for task in tasks:  # one by one: if a start fails, `fence` still ends those already started
            self.processes.append(start_worker(task, self.spec_path, self.extra_env, self.log_fn, self.log_lock))
        started = time.monotonic()
        watches = {p.task.name: HeartbeatWatch(os.path.join(self.spec.heartbeat_dir, heartbeat_name(p.task.cluster)),
                                               started)
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
                    return AttemptOutcome("ok", task=chief.task.name)
            for name, watch in watches.items():
                if codes[name] is not None:
                    continue
                watch.update(now)
                limit = hang_timeout if watch.has_beaten else hang_timeout + STARTUP_ALLOWANCE_S
                if watch.silent_for(now) > limit:
                    return self._hang(watches, codes, now)
            time.sleep(POLL_S)

    def _hang(self, watches: dict[str, HeartbeatWatch], codes: dict[str, int | None], now: float) -> AttemptOutcome:
        running = {n: w for n, w in watches.items() if codes[n] is None}
        # One silent peer stalls the whole all-reduce, so every task goes quiet at about the same time (and
        # heartbeats are throttled): a stopped process is the culprit when there is one, else the oldest beat.
        pids = {p.task.name: p.popen.pid for p in self.processes}
        stopped = [n for n in running if is_stopped(pids[n])]
        name = stopped[0] if stopped else min(running, key=lambda n: running[n].last_progress)
        watch = running[name]
        where = f"after step {watch.last_step}" if watch.has_beaten else "before its first step"
        state = " (stopped)" if stopped else ""
        cause = (f"hang: {name}{state} made no progress for {watch.silent_for(now):.1f} s {where} "
                 f"(train.hang_timeout_s {self.config.train.hang_timeout_s:g} s)")
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
                return AttemptOutcome("permanent", cause=f"{name} {describe_exit(code)}", task=name, exit_code=code,
                                      tail=by_name[name].traceback_tail())
            # Every failure is TensorFlow reporting a lost or silent peer: retryable, and the cause is that peer.
            name, code = failures[0]
            return AttemptOutcome("retryable", cause=self._lost_peer_cause(name, by_name[name].traceback_tail()),
                                  task=name, exit_code=code)
        name, code = next((n, c) for n, c in failures if kinds[n] == "retryable")
        if code == PREEMPTION_EXIT_CODE:
            self._wait_for_peers(PREEMPTION_GRACE_S)
        return AttemptOutcome("retryable", cause=f"{name} {describe_exit(code)}", task=name, exit_code=code)

    def _lost_peer_cause(self, failed: str, tail: str) -> str:
        line = peer_failure_line(tail) or "a peer failed"
        now = time.monotonic()
        for process in self.processes:
            if process.task.name == failed or process.poll() is not None:
                continue
            if is_stopped(process.popen.pid):
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
        self.fence()
        shutil.rmtree(self.work_dir, ignore_errors=True)
