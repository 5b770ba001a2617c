"""The small protocol between the supervisor and a launcher: a task group that places tasks, and one task's handle.

The supervisor (`launch.supervisor`) and the restart loop (`launch.local.launch`) only see these two shapes, so the
exit classes, the watchdog phases and the restart story are written once for every launcher:

- `processes.LocalGroup`: worker processes on this machine;
- `ray_launcher.RayGroup`: one Ray actor per task on a placement group's bundle, each running the same worker
  process on its node.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol

from pipeline_lib.launch.processes import TaskSpec


class TaskHandle(Protocol):
    """One running task of an attempt, as the supervisor watches it."""

    task: TaskSpec

    def poll(self) -> int | None:
        """The exit code once the task ended (negative: killed by that signal), else None."""

    def kill(self) -> None:
        """End the task now (no-op when it has ended)."""

    def reap(self, timeout_s: float = 10.0) -> None:
        """Wait for the task to be gone and its output to be drained."""

    def traceback_tail(self, max_lines: int = 25) -> str:
        """The task's last output lines, from its last traceback when there is one."""

    def is_stopped(self) -> bool:
        """True when the task's process is stopped (SIGSTOP)."""

    def read_heartbeat(self) -> dict[str, Any] | None:
        """The task's latest heartbeat (`launch.heartbeat`), or None before its first."""

    def describe_exit(self, code: int) -> str:
        """The exit in words, with where the task ran when that helps."""

    def stop(self) -> None:
        """Ask the task to stop at the next step boundary with an agreed checkpoint and the preemption exit (its
        SIGTERM path): how an elastic run's group is stopped to grow."""


class TaskGroup(Protocol):
    """Places the tasks of each attempt and starts them; the supervisor fences and restarts."""

    def plan_attempt(self, workers: int | None = None) -> list[TaskSpec]:
        """The tasks of the next attempt, each with its TF_CONFIG (placement and free ports happen here), with
        `workers` training workers (None: train.workers; fewer only for an elastic run's resized attempt)."""

    def capacity(self, wait_s: float) -> int:
        """How many training workers (at most train.workers) could be placed now, waiting up to `wait_s` for that
        many: an elastic run asks after losing a worker (wait_s: train.elastic.wait_s) and, while it runs on fewer,
        whether more came back (wait_s 0)."""

    def start(self, task: TaskSpec, log_fn: Callable[[str], None], log_lock: threading.Lock) -> TaskHandle:
        """Start one task of the planned attempt; its output goes to `log_fn`, one prefixed line at a time."""

    def end_attempt(self) -> None:
        """Release what `plan_attempt` reserved, after every handle was killed (idempotent)."""

    def close(self) -> None:
        """Release everything of the launch (idempotent)."""
