"""The stage record of a pipeline run: `<run_dir>/stages.json`, written when the run starts and rewritten
atomically at every stage boundary. It holds the run's pipeline name, its config (credentials masked), the Prefect
flow run, and each stage that ran: how it ended, what it wrote (URIs), their digests, and the stage's result kept
as `<run_dir>/stages/<stage>.json` with its sha256. A resumed run (`tfdag run --resume`) reads it: a stage that
finished and whose kept result still has its digest is not run again."""

from __future__ import annotations

import enum
import hashlib
import json
import os
import socket
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, TypeAdapter

from pipeline_lib.config import RESUME_SAFE_KEYS, PipelineConfig
from pipeline_lib.core import runs, storage
from pipeline_lib.core.errors import UserError

STAGE_RECORD_NAME = "stages.json"
KEPT_DIR = "stages"  # <run_dir>/stages/<stage>.json: a stage's result, for a resumed run
SUMMARY = "summary"  # <run_dir>/stages/summary.json: a finished run's summary
LATEST = "latest"


class StageStatus(str, enum.Enum):
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"
    KILLED = "killed"


class StageEntry(BaseModel):
    """One stage of the run: its status, when it started (Unix seconds), how long it took, what it wrote."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    status: StageStatus
    started_at: float
    seconds: float | None = None
    outputs: dict[str, str] = {}  # what the stage wrote: URIs, the tracking run's id, a model URI
    digests: dict[str, str] = {}  # their digests where known: the manifest's fingerprint, the export's files
    kept: str | None = None  # the sha256 of the stage's result kept as <run_dir>/stages/<name>.json


class StageRecord(BaseModel):
    """The stages of one pipeline run, in the order they ran."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    pipeline: str
    run_name: str | None = None
    tracking_run_id: str | None = None
    created_at: float | None = None  # Unix seconds: when the run started (its first attempt)
    prefect_flow_run_id: str | None = None  # the flow run of the latest attempt
    config: dict[str, Any] = {}  # the run's config as every dump shows it: credentials masked
    host: str | None = None  # where the latest attempt runs, and its process: a resume refuses a run still alive
    pid: int | None = None
    summary: str | None = None  # the sha256 of the finished run's summary, kept as stages/summary.json
    stages: tuple[StageEntry, ...] = ()

    def stage(self, name: str) -> StageEntry | None:
        """The last entry of stage `name`, or None when it did not run."""
        found = [entry for entry in self.stages if entry.name == name]
        return found[-1] if found else None

    def finished(self, name: str) -> StageEntry | None:
        """The entry of stage `name` when its last attempt finished, else None."""
        entry = self.stage(name)
        return entry if entry is not None and entry.status == StageStatus.FINISHED else None


class ResumeError(UserError):
    """No run to resume as asked, or the run cannot be resumed with this config; the message names the fix."""


def files_digest(files: Mapping[str, str]) -> str:
    """One sha256 over a {relative path: sha256} listing (an export's `files`): equal exactly when every file is."""
    return hashlib.sha256(json.dumps(dict(sorted(files.items()))).encode()).hexdigest()


def write_stage_record(run_dir: str, record: StageRecord, storage_options: Mapping[str, Any] | None = None) -> str:
    """Write `<run_dir>/stages.json` atomically; returns its URI."""
    uri = storage.join(run_dir, STAGE_RECORD_NAME)
    fs, path = storage.get_fs(uri, dict(storage_options or {}))
    storage.write_bytes_atomic(fs, path, record.model_dump_json(indent=2).encode())
    return uri


def read_stage_record(run_dir: str, storage_options: Mapping[str, Any] | None = None) -> StageRecord | None:
    """The run's stage record, or None when it has none."""
    fs, path = storage.get_fs(storage.join(run_dir, STAGE_RECORD_NAME), dict(storage_options or {}))
    if not fs.exists(path):
        return None
    return StageRecord.model_validate_json(fs.cat_file(path))


def keep_result(run_dir: str, stage: str, result: Any, kind: Any,
                storage_options: Mapping[str, Any] | None = None) -> str:
    """Write a stage's result (of type `kind`: a pydantic model, `X | None`, ...) as `<run_dir>/stages/<stage>.json`
    (atomically); returns its sha256."""
    data = TypeAdapter(kind).dump_json(result)
    fs, path = storage.get_fs(storage.join(run_dir, KEPT_DIR, f"{stage}.json"), dict(storage_options or {}))
    storage.write_bytes_atomic(fs, path, data)
    return hashlib.sha256(data).hexdigest()


def read_kept(run_dir: str, name: str, digest: str | None, kind: Any,
              storage_options: Mapping[str, Any] | None = None) -> tuple[bool, Any]:
    """`(True, result)` for the result (of type `kind`) kept as `<run_dir>/stages/<name>.json` when the file has the
    sha256 `digest`; `(False, None)` when nothing was kept (`digest` None) or the file is gone or changed."""
    if digest is None:
        return False, None
    fs, path = storage.get_fs(storage.join(run_dir, KEPT_DIR, f"{name}.json"), dict(storage_options or {}))
    if not fs.exists(path):
        return False, None
    data = fs.cat_file(path)
    if hashlib.sha256(data).hexdigest() != digest:
        return False, None
    return True, TypeAdapter(kind).validate_json(data)


def finished_summary(run_dir: str, record: StageRecord, kind: Any,
                     storage_options: Mapping[str, Any] | None = None) -> Any | None:
    """The summary a finished run kept, or None when the run did not finish (or its summary is gone)."""
    found, summary = read_kept(run_dir, SUMMARY, record.summary, kind, storage_options)
    return summary if found else None


def find_run(output_root: str, pipeline: str, name: str = LATEST,
             storage_options: Mapping[str, Any] | None = None) -> tuple[str, StageRecord]:
    """The run directory and stage record of pipeline `pipeline`'s run `name` under `<output_root>/runs`; `latest`:
    the newest run that records this pipeline's name (not a name prefix: `digits` is not `digits-v2`).

    Raises:
        ResumeError: no such run, or the run belongs to another pipeline.
    """
    options = dict(storage_options or {})
    if name != LATEST:
        run_dir = runs.run_dir_for(output_root, name)
        record = read_stage_record(run_dir, options)
        if record is None:
            raise ResumeError(f"--resume {name!r}: {run_dir} holds no stage record ({STAGE_RECORD_NAME}); name a run "
                              f"that `tfdag run` started under {runs.runs_dir(output_root)} or use --resume "
                              "latest")
        if record.pipeline != pipeline:
            raise ResumeError(f"--resume {name!r}: that run is pipeline {record.pipeline!r}, not {pipeline!r} "
                              "(the config's name); resume it with its own config")
        return run_dir, record
    found = [(record.created_at or 0.0, run_dir, record)
             for run_dir, record in _records(runs.runs_dir(output_root), options)
             if record.pipeline == pipeline]
    if not found:
        raise ResumeError(f"--resume: no run of pipeline {pipeline!r} under {runs.runs_dir(output_root)} to "
                          "resume; start one with `tfdag run CONFIG`")
    _, run_dir, record = max(found, key=lambda item: item[0])
    return run_dir, record


def resume_point(config: PipelineConfig, name: str = LATEST) -> tuple[str, StageRecord]:
    """The run directory and stage record of the run `tfdag run CONFIG --resume NAME` continues.

    Raises:
        ResumeError: no such run; the config changed since the run started (the keys named); the run is still
            running in a live process of this host.
    """
    run_dir, record = find_run(config.output_root, config.name, name, config.storage_options)
    changed = config.changed_keys(record.config)
    if changed:
        raise ResumeError(
            f"--resume {record.run_name}: the config changed since that run started, at {', '.join(changed)}; a "
            "resumed run finishes what it started with the same config: restore those values, or start a new run "
            f"without --resume (only {', '.join(RESUME_SAFE_KEYS)} may change)")
    if record.summary is None and record.host == socket.gethostname() and record.pid not in (None, os.getpid()):
        try:
            os.kill(record.pid, 0)  # type: ignore[arg-type]
        except ProcessLookupError:
            pass
        except PermissionError:
            raise _still_running(record) from None
        else:
            raise _still_running(record)
    return run_dir, record


def model_check_due(config: PipelineConfig, earlier: StageRecord | None) -> bool:
    """Whether a run's model check is still to come: it is on, and no earlier attempt of the run (`earlier`, when
    resuming) finished the check or the whole run."""
    return config.evaluation.validate_model and not (
        earlier is not None and (earlier.summary is not None or earlier.finished("validate_model") is not None))


def _still_running(record: StageRecord) -> ResumeError:
    return ResumeError(f"--resume {record.run_name}: that run is still running (process {record.pid} on this host); "
                       "wait for it to end, or stop it, then resume")


def find_run_of_flow_run(output_root: str, flow_run_id: str,
                         storage_options: Mapping[str, Any] | None = None) -> tuple[str, StageRecord] | None:
    """The run a Prefect flow run started (a retry of that flow run resumes it), or None."""
    for run_dir, record in _records(runs.runs_dir(output_root), dict(storage_options or {})):
        if record.prefect_flow_run_id == flow_run_id:
            return run_dir, record
    return None


def _records(runs_dir: str, options: dict[str, Any]) -> list[tuple[str, StageRecord]]:
    fs, path = storage.get_fs(runs_dir, options)
    if not fs.exists(path):
        return []
    found = []
    for record_path in fs.glob(f"{path.rstrip('/')}/*/{STAGE_RECORD_NAME}"):
        run_name = record_path.rstrip("/").split("/")[-2]
        try:
            record = StageRecord.model_validate_json(fs.cat_file(record_path))
        except ValueError:  # not a stage record of this version: not a run to resume
            continue
        found.append((storage.join(runs_dir, run_name), record))
    return found
