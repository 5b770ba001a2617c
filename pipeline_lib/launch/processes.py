"""The processes of one attempt: what each task is, starting its worker process, streaming and ending it."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from pipeline_lib.cluster.info import ClusterInfo
from pipeline_lib.launch import forkserver
from pipeline_lib.launch.exits import describe_exit
from pipeline_lib.launch.heartbeat import heartbeat_name, read_heartbeat
from pipeline_lib.launch.spec import PARENT_PID_ENV

logger = logging.getLogger(__name__)

TAIL_LINES = 300
WORKER_MODULE = "pipeline_lib.launch.worker"
# The checkout holding pipeline_lib: workers import it from there whatever their working directory.
_PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """One process to start: its cluster value (TF_CONFIG) and whether the watchdog follows its heartbeat."""

    cluster: ClusterInfo
    is_trainer: bool
    env_tf_config: bool = True

    @property
    def name(self) -> str:
        return self.cluster.name


def is_stopped(pid: int) -> bool:
    """True when the process is stopped (SIGSTOP, state T in /proc/<pid>/stat); False when that cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, ValueError, IndexError):
        return False


class TaskProcess:
    """One running task: the Popen, the thread that streams its output to `log_fn`, and the tail of that output."""

    def __init__(self, task: TaskSpec, popen: subprocess.Popen | forkserver.ForkedProcess, log_fn: Callable[[str], None],
                 log_lock: threading.Lock, *, prefix: str | None = None, heartbeat_path: str | None = None):
        self.task = task
        self.popen = popen
        self.prefix = prefix if prefix is not None else f"[{task.name}] "
        self.heartbeat_path = heartbeat_path
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self._log_fn = log_fn
        self._log_lock = log_lock
        self.thread = threading.Thread(target=self._pump, name=f"tfdag-log-{task.name}", daemon=True)
        self.thread.start()

    def _pump(self) -> None:
        prefix = self.prefix
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

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(self.popen.pid, signal.SIGTERM)

    def reap(self, timeout_s: float = 10.0) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=timeout_s)
        self.thread.join(timeout=timeout_s)

    def is_stopped(self) -> bool:
        return is_stopped(self.popen.pid)

    def read_heartbeat(self) -> dict[str, Any] | None:
        return read_heartbeat(self.heartbeat_path) if self.heartbeat_path else None

    def describe_exit(self, code: int) -> str:
        return describe_exit(code)

    def traceback_tail(self, max_lines: int = 25) -> str:
        return traceback_tail(self.tail, max_lines)


def traceback_tail(output: Iterable[str], max_lines: int = 25) -> str:
    """A task's last output lines, from its last traceback when there is one, at most `max_lines`."""
    lines = list(output)
    start = max((i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")),
                default=max(0, len(lines) - max_lines))
    lines = lines[start:]
    if len(lines) > max_lines:
        lines = [lines[0], "  ..."] + lines[-(max_lines - 2):]
    return "\n".join(lines)


def worker_env(task: TaskSpec, extra_env: Mapping[str, str]) -> dict[str, str]:
    """The environment of a task's worker process: ours, `extra_env`, its TF_CONFIG and our pid as its parent."""
    env = dict(os.environ)
    env.update(extra_env)
    env.pop("TF_CONFIG", None)
    if task.env_tf_config:
        env["TF_CONFIG"] = task.cluster.to_tf_config()
    env["PYTHONUNBUFFERED"] = "1"
    env[PARENT_PID_ENV] = str(os.getpid())
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_PROJECT_ROOT, env.get("PYTHONPATH", "")) if p)
    return env


def start_worker(task: TaskSpec, spec_path: str, extra_env: Mapping[str, str], log_fn: Callable[[str], None],
                 log_lock: threading.Lock, *, prefix: str | None = None,
                 heartbeat_dir: str | None = None, fork: bool = False) -> TaskProcess:
    """Start `python -m pipeline_lib.launch.worker --spec SPEC_PATH` for `task` in its own session.

    Its output lines go to `log_fn` as `prefix + line` (default `[worker 1] `); `heartbeat_dir` is where the
    worker writes its heartbeat (the spec's `heartbeat_dir`), read by `TaskProcess.read_heartbeat`. With `fork`
    (and `TFDAG_FORK_SERVER` not 0) the process is forked by this process's fork server (`launch.forkserver`),
    which has TensorFlow imported already; if that server cannot start, the worker starts the plain way.
    """
    env = worker_env(task, extra_env)
    popen = _fork(env, spec_path) if fork and forkserver.enabled(env) else None
    if popen is None:
        popen = subprocess.Popen([sys.executable, "-m", WORKER_MODULE, "--spec", spec_path], env=env,
                                 stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 start_new_session=True)
    logger.debug("started %s as pid %d", task.name, popen.pid)
    path = os.path.join(heartbeat_dir, heartbeat_name(task.cluster)) if heartbeat_dir else None
    return TaskProcess(task, popen, log_fn, log_lock, prefix=prefix, heartbeat_path=path)


def _fork(env: dict[str, str], spec_path: str) -> forkserver.ForkedProcess | None:
    """The worker forked by the fork server for `env` (its parent, so the pid a worker dies with); None when that
    server cannot start or fork (told as a warning)."""
    try:
        server = forkserver.server_for(env)
        return server.spawn(WORKER_MODULE, ["--spec", spec_path], {**env, PARENT_PID_ENV: str(server.pid)},
                            os.getcwd())
    except (OSError, RuntimeError) as error:
        logger.warning("starting the worker without the fork server: %s", error)
        return None


# The task of a one-process launch (no TF_CONFIG); every launch of this process shares its fork server (the server is
# keyed by the import-time variables, which TF_CONFIG is not).
ONE_PROCESS = TaskSpec(ClusterInfo(), is_trainer=True, env_tf_config=False)


def warm_fork_server(extra_env: Mapping[str, str]) -> forkserver.ForkServer | None:
    """Start (or find) the fork server `start_worker(..., fork=True)` uses for this process's launches with
    `extra_env`, and return it; None when the fork server is off or cannot start (the launch then starts workers
    the plain way)."""
    env = worker_env(ONE_PROCESS, extra_env)
    if not forkserver.enabled(env):
        return None
    try:
        return forkserver.server_for(env)
    except (OSError, RuntimeError):
        return None
