"""Generic process control for the stack: start a long-running process, find it again, stop it with its family."""

from __future__ import annotations

import contextlib
import datetime as _dt
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import psutil
from pydantic import BaseModel, ConfigDict

logger = logging.getLogger(__name__)

# psutil's start time is the boot time (/proc/stat's `btime`, whole seconds derived from the wall clock) plus
# ticks since boot; `btime` moves by a second when the clock is stepped (VM clock syncs), so a live service read
# twice can differ by about 1 s. A pid reused by another process within 2 s of the first one's start is
# not a case that happens: the kernel hands pids out in a cycle.
_START_TIME_SLACK_S = 2.0


class StackError(RuntimeError):
    """The local stack cannot start or stop; the message names what failed, where its log is and the fix."""


class ServiceRecord(BaseModel):
    """One process the stack started: enough to find exactly that process again."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    pid: int
    create_time: float  # psutil's process start time: a reused pid has another
    command: tuple[str, ...]
    log_path: str
    url: str | None = None


def now() -> str:
    """UTC now, to the second, for log banners and the state file."""
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


def base_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment for a stack process: no telemetry and no network needed, unbuffered output."""
    env = dict(os.environ)
    env.update({"PREFECT_SERVER_ANALYTICS_ENABLED": "false", "MLFLOW_DISABLE_TELEMETRY": "true",
                "DO_NOT_TRACK": "1", "PYTHONUNBUFFERED": "1"})
    env.update(extra or {})
    return env


def console_script(name: str) -> str:
    """The console script beside this interpreter (the project's virtualenv), else on PATH."""
    candidate = Path(sys.executable).parent / name
    if candidate.exists():
        return str(candidate)
    found = shutil.which(name)
    if not found:
        raise StackError(f"the {name!r} command is not installed beside {sys.executable} nor on PATH; "
                         "install tfdag's dependencies (make install)")
    return found


def start_process(name: str, command: Sequence[str], log_path: Path, *, env: Mapping[str, str],
                  cwd: str | os.PathLike[str] | None = None, url: str | None = None) -> ServiceRecord:
    """Start a long-running process in its own session (so `stop_process` can stop its children too).

    Returns:
        The record that identifies exactly this process later (pid and start time).
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        log.write(f"\n=== {now()} {' '.join(command)}\n".encode())
        log.flush()
        process = subprocess.Popen(list(command), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   cwd=cwd, env=dict(env), start_new_session=True)
    create_time = psutil.Process(process.pid).create_time()
    logger.info("started %s (pid %d): %s; log %s", name, process.pid, " ".join(command), log_path)
    return ServiceRecord(name=name, pid=process.pid, create_time=create_time, command=tuple(command),
                         log_path=str(log_path), url=url)


def find_process(record: ServiceRecord) -> psutil.Process | None:
    """The live process of a record, or None when it exited or its pid now belongs to another process."""
    try:
        process = psutil.Process(record.pid)
        if abs(process.create_time() - record.create_time) > _START_TIME_SLACK_S:
            return None
        if process.status() == psutil.STATUS_ZOMBIE:
            return None
        return process
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def end_processes(family: Iterable[psutil.Process], timeout_s: float, *, graceful: bool = True) -> bool:
    """End every process of `family`: with `graceful`, SIGTERM and SIGKILL for what is left after `timeout_s`;
    without, SIGKILL at once and up to `timeout_s` for them to go.

    Returns:
        Whether a process outlived its SIGTERM and was killed (never, without `graceful`).
    """
    family = list(family)
    if graceful:
        for member in family:
            with contextlib.suppress(psutil.Error):
                member.send_signal(signal.SIGTERM)
        _gone, alive = psutil.wait_procs(family, timeout=timeout_s)
    else:
        alive = family
    for member in alive:
        with contextlib.suppress(psutil.Error):
            member.kill()
    psutil.wait_procs(alive, timeout=5 if graceful else timeout_s)
    return graceful and bool(alive)


def stop_process(record: ServiceRecord, timeout_s: float = 15.0) -> str:
    """Stop the recorded process and its children: SIGTERM, then SIGKILL after `timeout_s`.

    Only the process whose pid *and* start time match the record is touched, with the processes it started.

    Returns:
        What happened, for the `down` report.
    """
    process = find_process(record)
    if process is None:
        return f"{record.name} (pid {record.pid}) was not running"
    try:
        family = [process, *process.children(recursive=True)]
    except psutil.NoSuchProcess:
        return f"{record.name} (pid {record.pid}) exited"
    killed = end_processes(family, timeout_s)
    # Reap our own child (when `up` ran in this process) so it leaves no zombie.
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(record.pid, os.WNOHANG)
    return f"{record.name} (pid {record.pid}) {'killed' if killed else 'stopped'}"


def http_ok(url: str, expect: Callable[[bytes], bool] | None = None, timeout_s: float = 2.0) -> bool:
    """Whether GET `url` answers 200 (and its body passes `expect`)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            body = response.read()
            return response.status == 200 and (expect is None or expect(body))
    except (urllib.error.URLError, OSError, ValueError):
        return False


def tail(path: str | os.PathLike[str], num_chars: int = 3000) -> str:
    with contextlib.suppress(OSError):
        return Path(path).read_text(errors="replace")[-num_chars:]
    return ""


def wait_until(check: Callable[[], bool], record: ServiceRecord, what: str, timeout_s: float) -> None:
    """Poll `check` until it holds; fail early when the process exits.

    Raises:
        StackError: naming the service, its log and the log's tail.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        if find_process(record) is None:
            raise StackError(f"{record.name} exited before {what}; see {record.log_path}:\n{tail(record.log_path)}")
        time.sleep(0.5)
    raise StackError(f"{record.name} did not reach {what} within {timeout_s:.0f} s; see {record.log_path}:\n"
                     f"{tail(record.log_path)}")


def run_command(command: Sequence[str], *, env: Mapping[str, str], cwd: str | os.PathLike[str] | None = None,
                log_path: Path | None = None, timeout_s: float = 300.0, check: bool = True,
                error: type[StackError] = StackError) -> subprocess.CompletedProcess:
    """Run one short command; its output is appended to `log_path` when given.

    Raises:
        StackError (or `error`): when `check` and the command fails, with its output's tail and the log.
    """
    result = subprocess.run(list(command), env=dict(env), cwd=cwd, capture_output=True, text=True,
                            timeout=timeout_s, stdin=subprocess.DEVNULL, check=False)
    where = ""
    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "a") as log:
            log.write(f"\n=== {now()} {' '.join(command)} (exit {result.returncode})\n{result.stdout}{result.stderr}")
        where = f"; see {log_path}"
    if check and result.returncode != 0:
        raise error(f"`{' '.join(command)}` failed with exit code {result.returncode}{where}:\n"
                    f"{(result.stdout + result.stderr)[-3000:]}")
    return result
