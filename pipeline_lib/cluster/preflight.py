"""Cross-worker preflight: every task's fingerprint on shared storage, a barrier, a comparison and a port check.

Every task of a cluster (chief, workers, parameter servers) calls `run_preflight` before it builds
its strategy. The protocol, all through fsspec under `<run_dir>/preflight/`:

1. The task opens a plain TCP listener on its own TF_CONFIG port (TensorFlow's gRPC server is not up
   yet), then writes `<type>-<index>.json`: its fingerprint (versions, TF build, GPUs, masked env,
   config and data hashes, TF_CONFIG) with a nonce, host and pid. Finding another live writer's file
   in its slot means two tasks claim the same type and index: it writes `conflict-<type>-<index>.json`
   and every task fails.
2. It waits (bounded by `timeout_s`) for every peer's fingerprint and compares them: any difference
   in versions, config hash, data hash or cluster spec fails every task with one table showing the
   values per task. GPU or TF build differences are warnings.
3. It connects to every peer's host:port. An unreachable peer is named; the task writes
   `failed-<type>-<index>.json` so that the others stop too.
4. It writes `reached-<type>-<index>.json` and keeps its listener open until every peer has written
   its own: no task closes its port before every peer has checked it. Then it closes the listener so
   the TF server can bind the port, and the chief writes `report.json` and `report.md`.

The preflight directory must be fresh for each attempt (the launcher removes it before a restart).

Test-only override: the environment variable `TFDAG_PREFLIGHT_OVERRIDE` holds a JSON object whose
keys replace fields of this task's fingerprint before it is written, so a test can fake a skewed
node, e.g. `TFDAG_PREFLIGHT_OVERRIDE='{"tensorflow": "2.13.1"}'`; with `"task": "worker 1"` in the object
only that task applies it (how a whole local `tfdag run` fakes one skewed worker). Keys: the version names (python,
tensorflow, keras, protobuf, numpy, tfdag), `config_hash`, `data_hash`, the TF build keys
(`cuda_version`, `cudnn_version`, ...) and `gpus` (a list of {"device", "name", "memory_mb"}). The
overridden keys are recorded in the fingerprint's `overrides` and reported as a warning.
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import logging
import os
import selectors
import socket
import threading
import time
import uuid
from collections.abc import Mapping
from typing import Any, TextIO

from pydantic import BaseModel, ConfigDict, ValidationError

from pipeline_lib.cluster.validation import (
    ClusterConfigError,
    ClusterInfo,
    GpuInfo,
    check_tf_config,
    cluster_from_env,
    package_versions,
    parse_strategy,
    relevant_env,
    split_address,
    tf_build_info,
    visible_gpus,
)
from pipeline_lib.core import storage
from pipeline_lib.core.errors import TfdagError

logger = logging.getLogger(__name__)

PREFLIGHT_DIR = "preflight"
REPORT_JSON = "report.json"
REPORT_MD = "report.md"
OVERRIDE_ENV = "TFDAG_PREFLIGHT_OVERRIDE"
POLL_INTERVAL_S = 0.1
# Object stores bill and throttle per request: every task lists the directory on each poll.
REMOTE_POLL_INTERVAL_S = 1.0
CONNECT_RETRY_S = 0.2
COMPARED_VERSIONS = ("python", "tensorflow", "keras", "protobuf", "numpy", "tfdag")
# Tasks that run a server and take part in the preflight; an evaluator runs neither.
PEER_JOBS = ("chief", "worker", "ps")
VALIDATE_CLUSTER_SUBDIR = "validate-cluster"


class PreflightError(TfdagError, RuntimeError):
    """The cluster's tasks differ, a peer is missing or unreachable, or two tasks claim one slot."""

    def __init__(self, message: str, report: PreflightReport | None = None):
        super().__init__(message)
        self.report = report


class Fingerprint(BaseModel):
    """What one task reports about itself; every task of a cluster must agree on the compared fields."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    task_type: str
    task_index: int
    host: str
    pid: int
    nonce: str
    written_at: float
    versions: dict[str, str]
    tf_build: dict[str, str]
    gpus: tuple[GpuInfo, ...] = ()
    env: dict[str, str] = {}  # TF_*, XLA_FLAGS, CUDA_VISIBLE_DEVICES; secrets masked
    config_hash: str
    data_hash: str
    tf_config: str
    overrides: tuple[str, ...] = ()  # fields replaced through TFDAG_PREFLIGHT_OVERRIDE

    @property
    def task(self) -> str:
        return f"{self.task_type} {self.task_index}"

    @property
    def cluster(self) -> dict[str, list[str]]:
        data = json.loads(self.tf_config) if self.tf_config else {}
        return {job: list(addresses) for job, addresses in sorted(data.get("cluster", {}).items())}


class PreflightReport(BaseModel):
    """The preflight as one task saw it: every fingerprint, the warnings, the errors and the peers checked."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    task: str
    passed: bool
    fingerprints: tuple[Fingerprint, ...]
    warnings: tuple[str, ...] = ()
    errors: tuple[str, ...] = ()
    reachable: dict[str, str] = {}  # "worker 1" -> "127.0.0.1:2223"

    def to_json(self) -> str:
        return self.model_dump_json(indent=2)

    def to_markdown(self) -> str:
        """One column per task: versions, hashes, GPUs, then the warnings and errors."""
        tasks = [f.task for f in self.fingerprints]
        lines = [f"# Preflight ({'passed' if self.passed else 'failed'}, reported by {self.task})", "",
                 "| field | " + " | ".join(tasks) + " |", "|---|" + "---|" * len(tasks)]
        for field, _fix in _compared_fields():
            values = [_cell(field, _value(f, field)) for f in self.fingerprints]
            lines.append(f"| {field} | " + " | ".join(values) + " |")
        for key in ("cuda_version", "cudnn_version"):
            lines.append(f"| {key} | " + " | ".join(f.tf_build.get(key, "") for f in self.fingerprints) + " |")
        lines.append("| GPUs | " + " | ".join(_gpu_words(f.gpus) for f in self.fingerprints) + " |")
        lines.append("| host | " + " | ".join(f.host for f in self.fingerprints) + " |")
        if self.reachable:
            lines += ["", "Reachable peers: " + ", ".join(f"{t} ({a})" for t, a in self.reachable.items())]
        if self.warnings:
            lines += ["", "## Warnings", ""] + [f"- {w}" for w in self.warnings]
        if self.errors:
            lines += ["", "## Errors", ""] + ["```\n" + e + "\n```" for e in self.errors]
        return "\n".join(lines) + "\n"


# --- fingerprints --------------------------------------------------------------------------------------------

def _slot(task_type: str, task_index: int) -> str:
    return f"{task_type}-{task_index}"


def _apply_override(values: dict[str, Any], environ: Mapping[str, str]) -> tuple[dict[str, Any], tuple[str, ...]]:
    """Apply the test-only override; an optional "task" key ("worker 1") limits it to that one task."""
    text = environ.get(OVERRIDE_ENV, "").strip()
    if not text:
        return values, ()
    try:
        override = json.loads(text)
    except json.JSONDecodeError as error:
        raise PreflightError(f"{OVERRIDE_ENV} ({text!r}) is not valid JSON ({error}); write an object such as "
                             '\'{"tensorflow": "2.13.1"}\' or unset it') from None
    if not isinstance(override, dict):
        raise PreflightError(f"{OVERRIDE_ENV} ({text!r}) must be a JSON object of fingerprint fields")
    override = dict(override)
    target = override.pop("task", None)
    if target is not None and str(target) != f"{values['task_type']} {values['task_index']}":
        return values, ()
    allowed = {*values["versions"], *values["tf_build"], "config_hash", "data_hash", "gpus"}
    unknown = sorted(set(override) - allowed)
    if unknown:
        raise PreflightError(f"{OVERRIDE_ENV} sets unknown fingerprint field(s) {unknown}; allowed: "
                             f"{sorted(allowed)}")
    values = {**values, "versions": dict(values["versions"]), "tf_build": dict(values["tf_build"])}
    for key, value in override.items():
        if key in values["versions"]:
            values["versions"][key] = str(value)
        elif key in values["tf_build"]:
            values["tf_build"][key] = str(value)
        else:
            values[key] = value
    return values, tuple(sorted(override))


def collect_fingerprint(cluster: ClusterInfo, config_hash: str, data_hash: str,
                        environ: Mapping[str, str] | None = None) -> Fingerprint:
    """This process's fingerprint, with `TFDAG_PREFLIGHT_OVERRIDE` applied (see the module docstring).

    Args:
        cluster: this task's cluster value.
        config_hash: `PipelineConfig.config_hash()` of the run.
        data_hash: `Manifest.content_hash()` of the dataset.
        environ: the environment (default os.environ): env report, CUDA_VISIBLE_DEVICES, the override.

    Raises:
        PreflightError: the override is not a JSON object of known fields.
    """
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {
        "task_type": cluster.task_type,
        "task_index": cluster.task_index,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "nonce": uuid.uuid4().hex,
        "written_at": time.time(),
        "versions": {k: v for k, v in package_versions(COMPARED_VERSIONS[1:]).items()},
        "tf_build": tf_build_info(),
        "gpus": visible_gpus(environ),
        "env": relevant_env(environ),
        "config_hash": config_hash,
        "data_hash": data_hash,
        "tf_config": cluster.to_tf_config() if cluster.cluster else "",
    }
    values, overrides = _apply_override(values, environ)
    try:
        return Fingerprint(**values, overrides=overrides)
    except ValidationError as error:
        raise PreflightError(f"{OVERRIDE_ENV} gives a field a value of the wrong type: {error}") from None


# --- comparison ----------------------------------------------------------------------------------------------

def _compared_fields() -> list[tuple[str, str]]:
    """(field, fix) for every field all tasks must agree on."""
    fields = [(name, f"install the same {name} version on every node (one container image for every task)")
              for name in COMPARED_VERSIONS]
    fields[0] = ("python", "use the same Python version on every node (one container image for every task)")
    return fields + [
        ("config_hash", "every task must run the same pipeline config (the same worker spec)"),
        ("data_hash", "every task must read the same dataset manifest (the same dataset_uri)"),
        ("cluster", "every task needs the same TF_CONFIG cluster; regenerate TF_CONFIG from one source"),
    ]


def _value(fingerprint: Fingerprint, field: str) -> str:
    if field in COMPARED_VERSIONS:
        return fingerprint.versions.get(field, "")
    if field == "cluster":
        return json.dumps(fingerprint.cluster, sort_keys=True)
    return getattr(fingerprint, field)


def _cell(field: str, value: str, width: int = 12) -> str:
    if field in ("config_hash", "data_hash"):
        return value[:width] if value else "(none)"
    if field == "cluster":
        import hashlib

        return "#" + hashlib.sha256(value.encode()).hexdigest()[:8]
    return value


def _gpu_words(gpus: tuple[GpuInfo, ...]) -> str:
    if not gpus:
        return "none"
    counts = collections.Counter(
        f"{g.name or 'unknown GPU'} ({g.memory_mb} MiB)" if g.memory_mb is not None else (g.name or "unknown GPU")
        for g in gpus)
    return ", ".join(f"{n}× {name}" for name, n in counts.items())


def _differences(fingerprints: list[Fingerprint], reporter: str) -> str | None:
    """The mismatch message (a table of the differing fields), or None when every task agrees."""
    rows = []
    fixes = []
    details = []
    for field, fix in _compared_fields():
        values = [_value(f, field) for f in fingerprints]
        if len(set(values)) < 2:
            continue
        reference = collections.Counter(values).most_common(1)[0][0]
        odd = [f.task for f, v in zip(fingerprints, values) if v != reference]
        same = [f.task for f, v in zip(fingerprints, values) if v == reference]
        rows.append((field, [_cell(field, v) for v in values], odd))
        theirs = ", ".join(f"{f.task} has {_cell(field, v)}" for f, v in zip(fingerprints, values) if v != reference)
        verb = "has" if len(same) == 1 else "have"
        fixes.append(f"  - {field}: {theirs} where {', '.join(same)} {verb} {_cell(field, reference)}; {fix}")
        if field == "cluster":
            expected = json.loads(reference)
            for f, v in zip(fingerprints, values):
                if v == reference:
                    continue
                theirs = json.loads(v)
                for job in sorted(set(expected) | set(theirs)):
                    if expected.get(job) != theirs.get(job):
                        details.append(f"  TF_CONFIG of {f.task} lists cluster.{job} {theirs.get(job)} but the "
                                       f"others list {expected.get(job)}")
    if not rows:
        return None
    names = [f.task for f in fingerprints]
    header = ["field"] + names + ["differs on"]
    table = [header] + [[field, *cells, ", ".join(odd)] for field, cells, odd in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    text = "\n".join("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table)
    message = (f"preflight ({reporter}): the {len(fingerprints)} tasks of this cluster do not match; every task must "
               f"run the same versions, config, data and cluster:\n{text}\n")
    if details:
        message += "\n".join(details) + "\n"
    message += "fix:\n" + "\n".join(fixes)
    return message


def _soft_warnings(fingerprints: list[Fingerprint]) -> list[str]:
    warnings = []
    trainers = [f for f in fingerprints if f.task_type in ("chief", "worker")]
    gpu_sets = {f.task: _gpu_words(f.gpus) for f in trainers}
    if len(set(gpu_sets.values())) > 1:
        warnings.append("GPUs differ between the training tasks: " +
                        "; ".join(f"{task} has {words}" for task, words in gpu_sets.items()) +
                        "; uneven GPUs make the replicas drift (the slowest sets the pace): use one node type")
    for key in ("cuda_version", "cudnn_version", "is_cuda_build"):
        values = {f.task: f.tf_build.get(key, "") for f in fingerprints}
        if len(set(values.values())) > 1:
            warnings.append(f"TensorFlow's {key} differs: " + ", ".join(f"{t} {v!r}" for t, v in values.items()) +
                            "; install the same TensorFlow wheel on every node")
    for f in fingerprints:
        if f.overrides:
            warnings.append(f"{f.task} reports a test override ({OVERRIDE_ENV}) of {', '.join(f.overrides)}")
    return warnings


# --- storage barrier -----------------------------------------------------------------------------------------

class _Board:
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


def _read_fingerprint(board: _Board, name: str, task: str) -> Fingerprint:
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


def _claim(board: _Board, me: Fingerprint) -> None:
    """Write this task's fingerprint, refusing a slot another live task holds."""
    name = f"{_slot(me.task_type, me.task_index)}.json"
    existing = board.read(name)
    if existing and existing.get("nonce") != me.nonce:
        other_host, other_pid = existing.get("host"), existing.get("pid")
        stale = other_host == me.host and (other_pid == me.pid or not _pid_alive(int(other_pid or 0)))
        if not stale:
            _raise_conflict(board, me, other_host, other_pid)
        logger.info("preflight: replacing a stale fingerprint of %s (pid %s on %s)", me.task, other_pid, other_host)
    board.write(name, me.model_dump_json(indent=2))


def _raise_conflict(board: _Board, me: Fingerprint, other_host: Any, other_pid: Any) -> None:
    message = (f"two tasks claim {me.task}: pid {other_pid} on {other_host} and pid {me.pid} on {me.host}; give "
               f"every task its own task.index in TF_CONFIG (type {me.task_type!r}, indices 0..N-1)")
    board.write(f"conflict-{_slot(me.task_type, me.task_index)}.json", {"task": me.task, "message": message})
    raise PreflightError(message)


def _check_markers(board: _Board, names: set[str], me: Fingerprint, own_name: str) -> None:
    for name in sorted(n for n in names if n.startswith("conflict-")):
        data = board.read(name) or {}
        raise PreflightError(data.get("message") or f"two tasks claim one slot ({name})")
    own = board.read(own_name)
    if own is not None and own.get("nonce") != me.nonce:
        _raise_conflict(board, me, own.get("host"), own.get("pid"))


def _check_failed(board: _Board, names: set[str], me: Fingerprint) -> None:
    for name in sorted(n for n in names if n.startswith("failed-")):
        data = board.read(name) or {}
        if data.get("task") == me.task:
            continue
        raise PreflightError(f"preflight failed on {data.get('task', name)}, so {me.task} stops too:\n"
                             f"{data.get('message', '(no message)')}")


def _wait_for(board: _Board, expected: dict[str, str], me: Fingerprint, deadline: float, timeout_s: float,
              what: str) -> set[str]:
    """Poll until every expected file exists; `expected` maps file names to task names."""
    own_name = f"{_slot(me.task_type, me.task_index)}.json"
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


# --- TCP listener and reachability -----------------------------------------------------------------------------

class _Listener:
    """A plain TCP listener on this task's port so peers can check it before TensorFlow's server exists.

    Accepted connections are closed only after the peer closes them, so no TIME_WAIT is left on this
    port's side and the TF server can bind it at once.
    """

    def __init__(self, port: int, task: str, address: str):
        family = socket.AF_INET6 if socket.has_dualstack_ipv6() else socket.AF_INET
        try:
            self.sock = socket.create_server(("", port), family=family, backlog=128,
                                             dualstack_ipv6=family == socket.AF_INET6)
        except OSError as error:
            raise PreflightError(
                f"{task} cannot listen on port {port} of its TF_CONFIG address {address!r}: {error}; another "
                f"process on this host holds it (a second task claiming {task}, or a TF server still running): "
                "stop it or give the task a free port"
            ) from None
        self.sock.setblocking(False)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"preflight-listener-{port}", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self.sock, selectors.EVENT_READ)
        try:
            while not self._stop.is_set():
                for key, _mask in selector.select(timeout=0.05):
                    if key.fileobj is self.sock:
                        try:
                            conn, _addr = self.sock.accept()
                        except (BlockingIOError, OSError):
                            continue
                        conn.setblocking(False)
                        selector.register(conn, selectors.EVENT_READ)
                    else:
                        try:
                            data = key.fileobj.recv(64)
                        except (BlockingIOError, InterruptedError):
                            continue
                        except OSError:
                            data = b""
                        if not data:
                            selector.unregister(key.fileobj)
                            key.fileobj.close()
        finally:
            for key in list(selector.get_map().values()):
                if key.fileobj is not self.sock:
                    key.fileobj.close()
            selector.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sock.close()


def _probe(address: str, deadline: float) -> str | None:
    """None when host:port accepts a TCP connection before the deadline, else why not."""
    host, port = split_address(address)
    last = "no attempt was made"
    while True:
        try:
            infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        except socket.gaierror as error:
            last = f"host {host!r} does not resolve ({error})"
        else:
            for family, kind, proto, _name, sockaddr in infos:
                try:
                    with socket.socket(family, kind, proto) as sock:
                        sock.settimeout(max(0.1, min(1.0, deadline - time.monotonic())))
                        sock.connect(sockaddr)
                    return None
                except OSError as error:
                    last = f"{sockaddr[0]}:{sockaddr[1]} refused or timed out ({type(error).__name__}: {error})"
        if time.monotonic() + CONNECT_RETRY_S >= deadline:
            return last
        time.sleep(CONNECT_RETRY_S)


def _check_peers(peers: dict[str, str], deadline: float) -> dict[str, str | None]:
    if not peers:
        return {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(32, len(peers))) as pool:
        futures = {task: pool.submit(_probe, address, deadline) for task, address in peers.items()}
        return {task: future.result() for task, future in futures.items()}


# --- the preflight -------------------------------------------------------------------------------------------

def _participants(cluster: ClusterInfo) -> dict[str, str]:
    """'worker 1' -> 'host:port' for every task that takes part, in cluster order (chief, workers, ps)."""
    return {f"{job} {i}": address for job in PEER_JOBS for i, address in enumerate(cluster.cluster.get(job, ()))}


def run_preflight(run_dir: str, cluster: ClusterInfo, config_hash: str, data_hash: str, timeout_s: float,
                  storage_options: dict | None = None) -> PreflightReport:
    """Run this task's part of the cross-worker preflight (see the module docstring for the protocol).

    Call it in every task (chief, workers, ps) before building the strategy, with the same run_dir.

    Args:
        run_dir: fsspec URI every task can read and write (shared storage on a real cluster).
        cluster: this task's cluster value (from TF_CONFIG).
        config_hash: `PipelineConfig.config_hash()`; every task must have the same.
        data_hash: `Manifest.content_hash()`; every task must have the same.
        timeout_s: the bound on the whole preflight (`preflight.timeout_s`).
        storage_options: fsspec options for run_dir.

    Returns:
        The PreflightReport; the chief also writes it to `<run_dir>/preflight/report.{json,md}`.

    Raises:
        PreflightError: the tasks differ, a peer never arrived or is unreachable, two tasks claim one
            slot, or a peer failed its own preflight. Every task raises, with the same diff.
    """
    deadline = time.monotonic() + timeout_s
    board = _Board(run_dir, storage_options)
    me = collect_fingerprint(cluster, config_hash, data_hash)
    participants = _participants(cluster)
    if me.task not in participants:
        # Single process (no TF_CONFIG) or an evaluator: nobody waits on it, it listens on nothing.
        participants = {me.task: ""} if not cluster.cluster else participants
    fingerprints: list[Fingerprint] = []
    warnings: list[str] = []
    reachable: dict[str, str] = {}
    listener = None
    try:
        own_address = participants.get(me.task, "")
        if own_address and len(participants) > 1:
            _host, port = split_address(own_address)
            listener = _Listener(int(port), me.task, own_address)
        _claim(board, me)
        expected = {f"{name.replace(' ', '-')}.json": name for name in participants}
        _wait_for(board, expected, me, deadline, timeout_s, "its fingerprint")
        fingerprints = [me if name == me.task else _read_fingerprint(board, file, name)
                        for file, name in expected.items()]
        if me.task not in participants:
            fingerprints.append(me)
        warnings = _soft_warnings(fingerprints)
        mismatch = _differences(fingerprints, me.task)
        if mismatch:
            raise PreflightError(mismatch)
        if listener is not None:
            peers = {task: address for task, address in participants.items() if task != me.task}
            results = _check_peers(peers, deadline)
            unreachable = {task: why for task, why in results.items() if why is not None}
            if unreachable:
                raise PreflightError(
                    f"preflight of {me.task}: " + "; ".join(
                        f"{task} at {peers[task]} is unreachable within {timeout_s:g} s: {why}"
                        for task, why in unreachable.items())
                    + "; check the address in TF_CONFIG, that the task runs on that host, and that firewalls or "
                      "network policies allow the port")
            reachable = {task: peers[task] for task in results}
            board.write(f"reached-{_slot(me.task_type, me.task_index)}.json", {"task": me.task, "peers": reachable})
            reached = {f"reached-{name.replace(' ', '-')}.json": name for name in participants}
            _wait_for(board, reached, me, deadline, timeout_s, "its reachability checks")
    except PreflightError as error:
        if me.task in participants and len(participants) > 1:
            try:
                board.write(f"failed-{_slot(me.task_type, me.task_index)}.json", {"task": me.task,
                                                                                   "message": str(error)})
            except OSError:  # pragma: no cover - the storage itself is failing; the error says enough
                logger.warning("preflight: could not record the failure of %s in %s", me.task, board.uri)
        report = PreflightReport(task=me.task, passed=False, fingerprints=tuple(fingerprints) or (me,),
                                 warnings=tuple(warnings), errors=(str(error),), reachable=reachable)
        _publish(board, cluster, report)
        error.report = report
        raise
    finally:
        if listener is not None:
            listener.close()
    report = PreflightReport(task=me.task, passed=True, fingerprints=tuple(fingerprints), warnings=tuple(warnings),
                             reachable=reachable)
    for warning in warnings:
        logger.warning("preflight: %s", warning)
    _publish(board, cluster, report)
    logger.info("preflight of %s passed: %d task(s) match, %d peer(s) reachable", me.task, len(fingerprints),
                len(reachable))
    return report


def _publish(board: _Board, cluster: ClusterInfo, report: PreflightReport) -> None:
    if not cluster.is_chief:
        return
    try:
        board.write(REPORT_JSON, report.to_json())
        board.write(REPORT_MD, report.to_markdown())
    except OSError as error:  # pragma: no cover - the report is a by-product; the outcome stands
        logger.warning("preflight: could not write the report to %s: %s", board.uri, error)


# --- `tfdag validate-cluster` ----------------------------------------------------------------------------------

def _read_tf_config(tf_config: str | None, environ: Mapping[str, str]) -> tuple[str, str]:
    """(text, source) from --tf-config (a file path, an fsspec URI or inline JSON) or $TF_CONFIG."""
    if tf_config is None:
        return environ.get("TF_CONFIG", "").strip(), "TF_CONFIG"
    stripped = tf_config.strip()
    if stripped.startswith(("{", "[")):
        return stripped, "--tf-config"
    if os.path.isfile(stripped) or "://" in stripped:
        fs, path = storage.get_fs(stripped)
        if fs.exists(path):
            return fs.cat_file(path).decode().strip(), stripped
    return stripped, "--tf-config (not an existing file, read as JSON)"


def run_validate_cluster(tf_config: str | None, strategy: str, peers: bool, run_dir: str | None, timeout_s: float,
                         out: TextIO, environ: Mapping[str, str] | None = None) -> int:
    """The body of `tfdag validate-cluster`: the static TF_CONFIG rules, then optionally the preflight.

    With `peers`, every task of the cluster runs this command (an init step in a pod, say); the preflight
    runs with empty config and data hashes, its files under `<run_dir>/validate-cluster/preflight/` so a
    later training preflight in the same run_dir starts from a fresh directory.

    Args:
        tf_config: a TF_CONFIG file path (local or fsspec) or inline JSON; None reads $TF_CONFIG.
        strategy: the strategy name the cluster is for.
        peers: also run the cross-worker preflight.
        run_dir: the shared fsspec URI for the preflight files (required with `peers`).
        timeout_s: bound on the preflight.
        out: where the findings and the report are printed.
        environ: the environment (default os.environ).

    Returns:
        0 when valid, 1 on an error finding or a failed preflight, 2 on a usage error.
    """
    environ = os.environ if environ is None else environ
    try:
        kind = parse_strategy(strategy)
    except ClusterConfigError as error:
        print(f"error: {error}", file=out)
        return 2
    text, source = _read_tf_config(tf_config, environ)
    if not text:
        print("error: TF_CONFIG is not set and --tf-config was not given; export TF_CONFIG or pass "
              "--tf-config FILE_OR_JSON", file=out)
        return 2
    findings = check_tf_config(text, kind, source)
    for finding in findings:
        print(f"{finding.level} [{finding.rule}]: {finding.message}", file=out)
    errors = [f for f in findings if f.level == "error"]
    if errors:
        print(f"{source}: {len(errors)} error(s), {len(findings) - len(errors)} warning(s); the cluster would not "
              "start as configured", file=out)
        return 1
    print(f"{source}: valid for strategy {kind.value!r} ({len(findings)} warning(s))", file=out)
    if not peers:
        return 0
    if not run_dir:
        print("error: --peers needs --run-dir, an fsspec URI every task can reach (e.g. s3://bucket/runs/job-1)",
              file=out)
        return 2
    cluster = cluster_from_env({"TF_CONFIG": text})
    try:
        report = run_preflight(storage.join(run_dir, VALIDATE_CLUSTER_SUBDIR), cluster, "", "", timeout_s)
    except PreflightError as error:
        print(f"preflight failed:\n{error}", file=out)
        return 1
    print(report.to_markdown(), file=out)
    print(f"preflight passed: {len(report.fingerprints)} task(s) match and every peer is reachable", file=out)
    return 0

