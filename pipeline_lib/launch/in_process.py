"""`train.isolation: none`: the one worker of a single-worker run trains in the train task's own process.

No worker process starts, so nothing imports TensorFlow a second time or starts Python again: the demo's
training stage costs its training and little else. The restart loop and the supervisor are the local launcher's
(`launch.local.launch`), over a `TaskGroup` whose one task is a thread running the same `worker.run_worker`:
its heartbeat, progress, Prometheus endpoint, exit codes and result file are a worker process's.

What a thread cannot give, and `train.isolation: process` (the default) does:
- a kill: a hang is still detected, but the supervisor can only ask the loop to stop at its next step boundary
  (the SIGTERM path: a checkpoint, then the preemption exit). A loop that does not come back is left running
  and the launch fails with `WorkerFailed` instead of starting a second training beside it;
- crash isolation: a segfault in TensorFlow ends the task's process, the flow with it;
- SIGTERM and test fault injection (`pipeline_lib.testing`), which act on processes.
"""

from __future__ import annotations

import collections
import os
import threading
from collections.abc import Callable
from typing import Any

from pipeline_lib.config import PipelineConfig
from pipeline_lib.data.manifest import Manifest
from pipeline_lib.launch import local, worker
from pipeline_lib.launch.errors import WorkerFailed
from pipeline_lib.launch.exits import describe_exit
from pipeline_lib.launch.heartbeat import heartbeat_name, read_heartbeat
from pipeline_lib.launch.processes import TAIL_LINES, TaskSpec, traceback_tail
from pipeline_lib.launch.protocol import DEFAULT_OPTIONS, LaunchOptions
from pipeline_lib.launch.spec import WorkerSpec
from pipeline_lib.planning.sharding import ShardPlan
from pipeline_lib.training.results import TrainResult

# How long a stop request may take to reach the loop's next step boundary before the task counts as left running.
STOP_GRACE_S = 30.0


class ThreadTask:
    """The `TaskHandle` of a worker running on a thread of this process."""

    def __init__(self, task: TaskSpec, spec: WorkerSpec, config: PipelineConfig, log_fn: Callable[[str], None],
                 log_lock: threading.Lock):
        self.task = task
        self.prefix = f"[{task.name}] "
        self.heartbeat_path = os.path.join(spec.heartbeat_dir, heartbeat_name(task.cluster))
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.stop_request = threading.Event()
        self._code: int | None = None
        self._log_fn = log_fn
        self._log_lock = log_lock
        self.thread = threading.Thread(
            target=self._run, args=(spec, config), name=f"tfdag-train-{task.name}", daemon=True)
        self.thread.start()

    def _run(self, spec: WorkerSpec, config: PipelineConfig) -> None:
        self._code = worker.exit_code(
            lambda: worker.run_worker(spec, self.task.cluster, config=config, stop=self.stop_request), self._report)

    def _report(self, text: str) -> None:
        for line in text.splitlines():
            self.tail.append(line)
            with self._log_lock:
                self._log_fn(self.prefix + line)

    def poll(self) -> int | None:
        return None if self.thread.is_alive() else self._code

    def kill(self) -> None:
        self.stop_request.set()

    def stop(self) -> None:
        self.stop_request.set()  # the same stop at the next step boundary: a thread cannot be killed

    def reap(self, timeout_s: float = 10.0) -> None:
        self.thread.join(timeout=max(timeout_s, STOP_GRACE_S))

    def is_stopped(self) -> bool:
        return False

    def read_heartbeat(self) -> dict[str, Any] | None:
        return read_heartbeat(self.heartbeat_path)

    def describe_exit(self, code: int) -> str:
        return describe_exit(code)

    def traceback_tail(self, max_lines: int = 25) -> str:
        return traceback_tail(self.tail, max_lines)


class InProcessGroup:
    """The `TaskGroup` of `train.isolation: none`: one task, on a thread; an attempt starts only once the
    previous attempt's thread has ended."""

    def __init__(self, spec: WorkerSpec, config: PipelineConfig):
        self.spec = spec
        self.config = config
        self.current: ThreadTask | None = None

    def plan_attempt(self, workers: int | None = None) -> list[TaskSpec]:
        if self.current is not None and self.current.thread.is_alive():
            raise WorkerFailed(
                f"{self.current.task.name} trains in this process (train.isolation: none) and did not stop within "
                f"{STOP_GRACE_S:g} s of the request, so it cannot be restarted beside itself; set "
                "train.isolation: process to have a hung worker killed and restarted",
                task=self.current.task.name, exit_code=-1, tail=self.current.traceback_tail())
        return local.plan_attempt(self.spec, self.config)

    def capacity(self, wait_s: float) -> int:
        return 1  # its one worker, on this process

    def start(self, task: TaskSpec, log_fn: Callable[[str], None], log_lock: threading.Lock) -> ThreadTask:
        self.current = ThreadTask(task, self.spec, self.config, log_fn, log_lock)
        return self.current

    def end_attempt(self) -> None:
        pass

    def close(self) -> None:
        pass


name = "in_process"
config_model = None  # `train.isolation: none` on the local launcher, which has no settings of its own
check_inputs = local.check_inputs


def warm_up(config: PipelineConfig) -> None:
    """Nothing to start: the worker trains on a thread of this process."""


def launch_training(config: PipelineConfig, manifest: Manifest, plan: ShardPlan, run_dir: str, *,
                    options: LaunchOptions = DEFAULT_OPTIONS) -> TrainResult:
    """The local launcher's `launch_training` with the one worker on a thread of this process."""
    return local.launch_training(config, manifest, plan, run_dir, options=options,
                                 make_group=lambda spec: InProcessGroup(spec, config))
