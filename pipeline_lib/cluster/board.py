"""The preflight's storage barrier: the small JSON files every task writes and polls under `<run_dir>/preflight/`."""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

from pydantic import ValidationError

from pipeline_lib.cluster.fingerprint import Fingerprint
from pipeline_lib.cluster.preflight_report import PreflightError
from pipeline_lib.cluster.probe import package_versions
from pipeline_lib.core import storage

logger = logging.getLogger(__name__)

PREFLIGHT_DIR = "preflight"
POLL_INTERVAL_S = 0.1
# Object stores bill and throttle per request: every task lists the directory on each poll.
REMOTE_POLL_INTERVAL_S = 1.0


class Board:
    """The preflight directory: listing, reading and writing the small JSON files of the protocol."""

    def __init__(self, run_dir: str, storage_options: dict | None):
        self.uri = storage.join(run_dir, PREFLIGHT_DIR)
        self.fs, self.path = storage.get_fs(self.uri, storage_options)
        self.fs.makedirs(self.path, exist_ok=True)
        self.poll_s = POLL_INTERVAL_S if storage.is_local(self.uri) else REMOTE_POLL_INTERVAL_S

    def file(self, name: str) -> str:
        return storage.join(self.path, name) if storage.is_local(self.uri) else f"{self.path.rstrip('/')}/{name}"

    def names(self) -> set[str]:
        # Object-store filesystems cache listings; a stale one would hide a peer that has arrived.
        self.fs.invalidate_cache(self.path)
        try:
            return {os.path.basename(p.rstrip("/")) for p in self.fs.ls(self.path, detail=False)}
        except FileNotFoundError:
            return set()

    def read(self, name: str) -> dict[str, Any] | None:
        try:
            return json.loads(self.fs.cat_file(self.file(name)))
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    def write(self, name: str, data: dict[str, Any] | str) -> None:
        payload = data if isinstance(data, str) else json.dumps(data, indent=2)
        storage.write_bytes_atomic(self.fs, self.file(name), payload.encode())


def read_fingerprint(board: Board, name: str, task: str) -> Fingerprint:
    """The fingerprint a peer wrote to `name`.

    Raises:
        PreflightError: the file is not JSON, or a different tfdag wrote it.
    """
    data = board.read(name)
    if data is None:
        raise PreflightError(f"the fingerprint of {task} ({board.file(name)}) is not readable JSON; a task wrote "
                             "something else in its slot: clear the preflight directory and restart")
    try:
        return Fingerprint.model_validate(data)
    except ValidationError as error:
        theirs = (data.get("versions") or {}).get("tfdag", "unknown") if isinstance(data, dict) else "unknown"
        raise PreflightError(
            f"the fingerprint of {task} ({board.file(name)}) was written by tfdag {theirs} and this tfdag "
            f"({package_versions(('tfdag',))['tfdag']}) cannot read it ({error.error_count()} problem(s)); install "
            "the same tfdag on every node"
        ) from None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def claim(board: Board, me: Fingerprint) -> None:
    """Write this task's fingerprint, refusing a slot another live task holds."""
    name = f"{me.slot}.json"
    existing = board.read(name)
    if existing and existing.get("nonce") != me.nonce:
        other_host, other_pid = existing.get("host"), existing.get("pid")
        stale = other_host == me.host and (other_pid == me.pid or not _pid_alive(int(other_pid or 0)))
        if not stale:
            _raise_conflict(board, me, other_host, other_pid)
        logger.info("preflight: replacing a stale fingerprint of %s (pid %s on %s)", me.task, other_pid, other_host)
    board.write(name, me.model_dump_json(indent=2))


def _raise_conflict(board: Board, me: Fingerprint, other_host: Any, other_pid: Any) -> None:
    message = (f"two tasks claim {me.task}: pid {other_pid} on {other_host} and pid {me.pid} on {me.host}; give "
               f"every task its own task.index in TF_CONFIG (type {me.task_type!r}, indices 0..N-1)")
    board.write(f"conflict-{me.slot}.json", {"task": me.task, "message": message})
    raise PreflightError(message)


def _check_markers(board: Board, names: set[str], me: Fingerprint, own_name: str) -> None:
    for name in sorted(n for n in names if n.startswith("conflict-")):
        data = board.read(name) or {}
        raise PreflightError(data.get("message") or f"two tasks claim one slot ({name})")
    own = board.read(own_name)
    if own is not None and own.get("nonce") != me.nonce:
        _raise_conflict(board, me, own.get("host"), own.get("pid"))


def _check_failed(board: Board, names: set[str], me: Fingerprint) -> None:
    for name in sorted(n for n in names if n.startswith("failed-")):
        data = board.read(name) or {}
        if data.get("task") == me.task:
            continue
        raise PreflightError(f"preflight failed on {data.get('task', name)}, so {me.task} stops too:\n"
                             f"{data.get('message', '(no message)')}")


def wait_for(board: Board, expected: dict[str, str], me: Fingerprint, deadline: float, timeout_s: float,
              what: str) -> set[str]:
    """Poll until every expected file exists; `expected` maps file names to task names."""
    own_name = f"{me.slot}.json"
    while True:
        names = board.names()
        _check_markers(board, names, me, own_name)
        missing = [task for name, task in expected.items() if name not in names]
        if not missing:
            return names
        _check_failed(board, names, me)
        if time.monotonic() >= deadline:
            files = ", ".join(board.file(n) for n, t in expected.items() if t in missing)
            raise PreflightError(
                f"preflight of {me.task} timed out after {timeout_s:g} s waiting for {', '.join(missing)} "
                f"({what}; missing {files}); check that the task started with the same run_dir and TF_CONFIG "
                "and see its log, or raise preflight.timeout_s"
            )
        time.sleep(board.poll_s)
