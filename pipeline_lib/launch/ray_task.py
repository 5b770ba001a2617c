"""What runs inside each task's Ray actor, on its node: the task's worker process, its output and its heartbeat.

This module does not import Ray: `ray_launcher` wraps `TaskRunner` in `ray.remote` and calls its methods from the
driver. The worker process is the same `python -m pipeline_lib.launch.worker` the local launcher starts
(`processes.start_worker`), so the worker's exit codes, heartbeats and SIGTERM handling are unchanged; only where
the supervisor reads them from differs: through `status`, an actor call, not a shared directory.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from typing import Any

from pipeline_lib.cluster.info import ClusterInfo
from pipeline_lib.core.net import free_port
from pipeline_lib.launch.processes import TaskProcess, TaskSpec, start_worker
from pipeline_lib.launch.spec import WorkerSpec, write_spec

MAX_BUFFERED_LINES = 20000


class TaskRunner:
    """One task on its node: starts the worker process and answers the driver's polls (`status`)."""

    def __init__(self, spec_json: str, extra_env: dict[str, str]):
        self.work_dir = tempfile.mkdtemp(prefix="tfdag-ray-task-")
        self.heartbeat_dir = os.path.join(self.work_dir, "heartbeats")
        os.makedirs(self.heartbeat_dir)
        # The heartbeat stays on this node; the driver reads it through `status`.
        spec = WorkerSpec.model_validate_json(spec_json).model_copy(update={"heartbeat_dir": self.heartbeat_dir})
        self.spec_path = write_spec(spec, self.work_dir)
        self.extra_env = dict(extra_env)
        self.process: TaskProcess | None = None
        self._lines: list[str] = []
        self._dropped = 0  # lines before self._lines[0]
        self._lock = threading.Lock()
        self._reaped = False

    def free_port(self, host: str) -> int:
        """A port free on this node's `host` right now: the task's TF_CONFIG address."""
        return free_port(host)

    def _append(self, line: str) -> None:
        self._lines.append(line)  # called under the pump's log lock
        if len(self._lines) > MAX_BUFFERED_LINES:  # a driver that stopped polling must not grow this forever
            cut = len(self._lines) - MAX_BUFFERED_LINES
            del self._lines[:cut]
            self._dropped += cut

    def start(self, cluster_json: str, is_trainer: bool, env_tf_config: bool,
              secret_env: dict[str, str] | None = None) -> int:
        """Start the worker process with this TF_CONFIG, and `secret_env` (the config's literal secrets) in its
        environment only; returns its pid."""
        task = TaskSpec(ClusterInfo.model_validate_json(cluster_json), is_trainer=is_trainer,
                        env_tf_config=env_tf_config)
        env = {**self.extra_env, **(secret_env or {})}
        self.process = start_worker(task, self.spec_path, env, self._append, self._lock, prefix="",
                                    heartbeat_dir=self.heartbeat_dir)
        return self.process.popen.pid

    def status(self, cursor: int) -> dict[str, Any]:
        """The exit code (None while running), the heartbeat, whether the process is stopped, and new output lines.

        `cursor` counts the lines the driver has; the answer's `cursor` is the count after these lines.
        """
        process = self.process
        code = process.poll() if process is not None else None
        if code is not None and not self._reaped:
            process.reap(timeout_s=5.0)  # the pump has the last lines once the pipe closes
            self._reaped = True
        with self._lock:
            start = max(cursor - self._dropped, 0)
            lines = self._lines[start:]
            end = self._dropped + len(self._lines)
        return {"code": code, "heartbeat": process.read_heartbeat() if process is not None else None,
                "stopped": process.is_stopped() if process is not None and code is None else False,
                "lines": lines, "cursor": end}

    def traceback_tail(self, max_lines: int = 25) -> str:
        return self.process.traceback_tail(max_lines) if self.process is not None else ""

    def stop(self) -> None:
        """SIGTERM the worker: it stops at the next step boundary with an agreed checkpoint (exit 138)."""
        if self.process is not None:
            self.process.stop()

    def kill(self) -> None:
        """SIGKILL the worker's process group and wait for it, before Ray ends this actor."""
        if self.process is not None:
            self.process.kill()
            self.process.reap(timeout_s=5.0)
        shutil.rmtree(self.work_dir, ignore_errors=True)
