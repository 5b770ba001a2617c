"""The stage record of a pipeline run: `<run_dir>/stages.json`, each stage that ran, how it ended, what it wrote
(URIs) and their digests where known, rewritten atomically at every stage boundary (a resumed run reads it)."""

from __future__ import annotations

import enum
import hashlib
import json
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict

from pipeline_lib.core import storage

STAGE_RECORD_NAME = "stages.json"


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


class StageRecord(BaseModel):
    """The stages of one pipeline run, in the order they ran."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    pipeline: str
    run_name: str | None = None
    tracking_run_id: str | None = None
    stages: tuple[StageEntry, ...] = ()

    def stage(self, name: str) -> StageEntry | None:
        """The last entry of stage `name`, or None when it did not run."""
        found = [entry for entry in self.stages if entry.name == name]
        return found[-1] if found else None


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
