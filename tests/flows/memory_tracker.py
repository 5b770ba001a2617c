"""A second tracking backend, in memory, for tests: every run, param, metric, artifact, model and registered version
in one `MemoryStore`. Installed for `memory://` tracking URIs with `register_tracker("memory", store.tracker)`."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from pipeline_lib.config import PipelineConfig
from pipeline_lib.core import storage
from pipeline_lib.data.manifest import Schema
from pipeline_lib.data.statistics import DatasetStatistics
from pipeline_lib.tracking.records import (
    BLESSED_TAG,
    CHAMPION_ALIAS,
    CONFIG_HASH_TAG,
    FINAL_METRIC_PREFIX,
    FINGERPRINT_TAG,
    SCHEMA_ARTIFACT,
    STATISTICS_ARTIFACT,
    Baseline,
    LoggedModel,
    ModelVersionInfo,
    RunStatus,
    VersionInfo,
    run_status,
)
from pipeline_lib.training.hooks import NullSink


@dataclasses.dataclass
class RunRecord:
    name: str
    experiment: str
    status: str = "RUNNING"
    tags: dict[str, str] = dataclasses.field(default_factory=dict)
    params: dict[str, str] = dataclasses.field(default_factory=dict)
    metrics: dict[str, list[tuple[int, float]]] = dataclasses.field(default_factory=dict)
    artifacts: dict[str, bytes] = dataclasses.field(default_factory=dict)
    datasets: list[str] = dataclasses.field(default_factory=list)

    def last(self, metric: str) -> float:
        return self.metrics[metric][-1][1]


@dataclasses.dataclass
class MemoryStore:
    """Everything the memory tracker recorded; `tracker(config)` is the factory `register_tracker` takes."""

    runs: dict[str, RunRecord] = dataclasses.field(default_factory=dict)
    models: dict[str, dict[str, bytes]] = dataclasses.field(default_factory=dict)  # model id → files
    versions: dict[str, list[VersionInfo]] = dataclasses.field(default_factory=dict)
    aliases: dict[tuple[str, str], int] = dataclasses.field(default_factory=dict)
    _ids: Iterator[int] = dataclasses.field(default_factory=itertools.count)

    def tracker(self, config: PipelineConfig) -> MemoryTracker:
        return MemoryTracker(config, self)

    def new_id(self, prefix: str) -> str:
        return f"{prefix}{next(self._ids)}"


def _read_files(value: str | bytes) -> dict[str, bytes] | bytes | None:
    """What an artifact value holds: bytes, a file's content, a directory's files by relative path, or text."""
    if isinstance(value, bytes):
        return value
    if "\n" in value or len(value) >= 4096 or not (value.startswith(("/", "./")) or "://" in value):
        return value.encode()
    fs, path = storage.get_fs(value)
    if not fs.exists(path):
        return None
    if not fs.isdir(path):
        return fs.cat_file(path)
    return {os.path.relpath(name, path): fs.cat_file(name) for name in fs.find(path)}


class MemorySink:
    def __init__(self, record: RunRecord):
        self.record = record

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        for name, value in metrics.items():
            self.record.metrics.setdefault(name, []).append((int(step), float(value)))

    def flush(self) -> None:
        pass


class MemoryRun:
    def __init__(self, tracker: MemoryTracker, run_id: str):
        self.tracker, self.run_id = tracker, run_id

    @property
    def record(self) -> RunRecord:
        return self.tracker.store.runs[self.run_id]

    def end(self, status: RunStatus | str = RunStatus.FINISHED, *, failed_stage: str | None = None) -> None:
        self.record.status = run_status(status).value
        if failed_stage:
            self.record.tags["tfdag.failed_stage"] = failed_stage

    def log_params(self, params: Mapping[str, Any]) -> None:
        self.record.params.update({k: str(getattr(v, "value", v)) for k, v in params.items()
                                   if not isinstance(v, Mapping)})

    def log_metrics(self, metrics: Mapping[str, float], *, prefix: str = FINAL_METRIC_PREFIX, step: int = 0) -> None:
        MemorySink(self.record).log_metrics({f"{prefix}{k}": v for k, v in metrics.items()
                                             if not math.isnan(float(v))}, step)

    def log_slice_metrics(self, slices: Sequence[Any]) -> None:
        for result in slices:
            values = {**result.metrics, "num_examples": float(result.num_examples)}
            self.log_metrics({result.metric_name(k): v for k, v in values.items()}, prefix="")

    def log_artifacts(self, files: Mapping[str, str | bytes]) -> None:
        for name, value in files.items():
            content = _read_files(value)
            if isinstance(content, bytes):
                self.record.artifacts[name] = content
            elif content is not None:
                self.record.artifacts.update({f"{name}/{rel}": data for rel, data in content.items()})

    def read_artifact(self, path: str) -> bytes:
        return self.record.artifacts[path]

    def log_datasets(self, manifest: Any, name: str) -> None:
        self.record.datasets += [f"{name}-{split}" for split in ("train", "eval") if manifest.num_records(split)]

    def log_model(self, saved_model_dir: str, keras_path: str | None, example_input: Any, *,
                  storage_options: Mapping[str, Any] | None = None, metrics: Mapping[str, float] | None = None,
                  metric_prefix: str = FINAL_METRIC_PREFIX) -> LoggedModel:
        model_id = self.tracker.store.new_id("m-")
        files = {"model.keras": storage.get_fs(keras_path)[0].cat_file(keras_path)} if keras_path else {}
        self.tracker.store.models[model_id] = files
        if metrics:
            self.log_metrics(metrics, prefix=metric_prefix)
        return LoggedModel(model_uri=f"memory-models:/{model_id}", model_id=model_id, run_id=self.run_id)

    def record_blessing(self, decision: Any) -> None:
        self.record.tags.update({"tfdag.blessed": str(decision.blessed).lower(), "tfdag.gate_reason": decision.reason})

    def record_model_validation(self, validation: Any) -> None:
        self.record.tags["tfdag.model_validated"] = str(validation.passed).lower()
        self.record.artifacts["evaluation/model_validation.json"] = validation.model_dump_json().encode()

    def record_restart(self, attempt: int, cause: str) -> None:
        self.record.tags[f"tfdag.restart.{attempt}"] = cause
        MemorySink(self.record).log_metrics({"num_restarts": attempt}, attempt)

    def record_resize(self, number: int, story: str, to_workers: int, step: int) -> None:
        self.record.tags[f"tfdag.resize.{number}"] = story
        self.record_workers(to_workers, step)

    def record_workers(self, workers: int, step: int) -> None:
        MemorySink(self.record).log_metrics({"workers": workers}, step)

    def set_tags(self, tags: Mapping[str, str]) -> None:
        self.record.tags.update({k: str(v) for k, v in tags.items()})

    def ui_url(self) -> str | None:
        return None


class MemoryTracker:
    """The tracking interface (`pipeline_lib.tracking.tracker.Tracker`) on a MemoryStore."""

    def __init__(self, config: PipelineConfig, store: MemoryStore):
        self.config, self.store, self.uri = config, store, config.mlflow_uri

    def start_run(self, run_name: str, *, tags: Mapping[str, Any] | None = None) -> MemoryRun:
        for run_id, record in self.store.runs.items():
            if record.name == run_name and record.status == "RUNNING":
                return MemoryRun(self, run_id)
        run_id = self.store.new_id("run-")
        self.store.runs[run_id] = RunRecord(name=run_name, experiment=self.config.tracking.experiment, tags={
            "tfdag.pipeline": self.config.name, "tfdag.config_hash": self.config.config_hash(),
            **{k: str(v) for k, v in (tags or {}).items()}})
        return MemoryRun(self, run_id)

    def reopen(self, run_id: str) -> MemoryRun:
        record = self.store.runs[run_id]
        record.status = "RUNNING"
        record.tags.pop("tfdag.failed_stage", None)
        return MemoryRun(self, run_id)

    def get_run(self, run_id: str) -> MemoryRun:
        return MemoryRun(self, run_id)

    def metrics_sink(self, run_id: str | None, *, is_chief: bool = True, flush_every: int = 50) -> Any:
        return MemorySink(self.store.runs[run_id]) if run_id and is_chief else NullSink()

    def system_metrics(self, run_id: str | None, *, is_chief: bool = True) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def warm_up(self) -> None:
        pass

    def register_model(self, logged: LoggedModel, name: str, *,
                       tags: Mapping[str, Any] | None = None) -> ModelVersionInfo:
        versions = self.store.versions.setdefault(name, [])
        earlier = [v.version for v in versions if v.run_id == logged.run_id]
        number = earlier[0] if earlier else len(versions) + 1
        if not earlier:
            versions.append(VersionInfo(name=name, version=number, run_id=logged.run_id, tags={
                "model_id": logged.model_id, **{k: str(v) for k, v in (tags or {}).items()}}))
        return ModelVersionInfo(name=name, version=number, model_uri=f"models:/{name}/{number}",
                                logged_model_uri=logged.model_uri, run_id=logged.run_id, flavor=logged.flavor)

    def record_decision(self, model_name: str, version: int | str, decision: Any, *, fingerprint: Any = None,
                        config_hash: str | None = None, alias: str | None = CHAMPION_ALIAS) -> VersionInfo:
        found = self._version(model_name, int(version))
        tags = {**found.tags, BLESSED_TAG: str(decision.blessed).lower(), "tfdag.decision_reason": decision.reason}
        if fingerprint is not None:
            tags[FINGERPRINT_TAG] = fingerprint.sha256
        if config_hash is not None:
            tags[CONFIG_HASH_TAG] = config_hash
        updated = found.model_copy(update={"tags": tags})
        self.store.versions[model_name][int(version) - 1] = updated
        if decision.blessed and alias:
            self.store.aliases[(model_name, alias)] = int(version)
        return updated

    def _version(self, model_name: str, version: int) -> VersionInfo:
        found = self.store.versions[model_name][version - 1]
        aliases = tuple(a for (name, a), v in self.store.aliases.items() if name == model_name and v == version)
        return found.model_copy(update={"aliases": aliases})

    def get_champion(self, model_name: str, alias: str = CHAMPION_ALIAS) -> VersionInfo | None:
        version = self.store.aliases.get((model_name, alias))
        return None if version is None else self._version(model_name, version)

    def latest_version(self, model_name: str) -> VersionInfo | None:
        versions = self.store.versions.get(model_name)
        return self._version(model_name, len(versions)) if versions else None

    def last_refused_run(self, fingerprint: Any, config_hash: str) -> str | None:
        refused = [run_id for run_id, r in self.store.runs.items() if r.tags.get("tfdag.blessed") == "false"
                   and r.tags.get(FINGERPRINT_TAG) == fingerprint.sha256 and r.tags.get(CONFIG_HASH_TAG) == config_hash]
        return refused[-1] if refused else None

    def download_keras_model(self, model_name: str, version: int | str, dst_dir: str) -> str:
        model_id = self._version(model_name, int(version)).tags["model_id"]
        path = os.path.join(dst_dir, "model.keras")
        with open(path, "wb") as handle:
            handle.write(self.store.models[model_id]["model.keras"])
        return path

    def find_baseline(self, against: str | None = None, exclude_run_id: str | None = None) -> Baseline | None:
        for run_id, record in reversed(list(self.store.runs.items())):
            if (run_id != exclude_run_id and record.status == "FINISHED"
                    and record.tags.get("tfdag.pipeline") == self.config.name and STATISTICS_ARTIFACT in record.artifacts):
                return Baseline(run_id=run_id, description=f"run {run_id}",
                                schema_=Schema.model_validate_json(record.artifacts[SCHEMA_ARTIFACT]),
                                statistics=DatasetStatistics.model_validate_json(record.artifacts[STATISTICS_ARTIFACT]))
        return None

    def start_trial_run(self, parent_run_id: str, study: str, number: int, params: Mapping[str, Any],
                        tags: Mapping[str, str] | None = None) -> MemoryRun:
        run = self.start_run(f"{study}-trial-{number}", tags={**(tags or {}), "mlflow.parentRunId": parent_run_id,
                                                             "tfdag.tune.trial": str(number)})
        run.log_params({f"tune.{k}": json.dumps(v) if isinstance(v, (list, dict)) else v for k, v in params.items()})
        return run

    def find_trial_run(self, parent_run_id: str, number: int) -> str | None:
        found = [run_id for run_id, r in self.store.runs.items() if r.tags.get("mlflow.parentRunId") == parent_run_id
                 and r.tags.get("tfdag.tune.trial") == str(number)]
        return found[-1] if found else None

    def end_stale_trial_runs(self, parent_run_id: str) -> list[str]:
        stale = [run_id for run_id, r in self.store.runs.items()
                 if r.tags.get("mlflow.parentRunId") == parent_run_id and r.status == "RUNNING"]
        for run_id in stale:
            self.get_run(run_id).end(RunStatus.KILLED)
        return stale

    def end_trial_run(self, run_id: str, *, state: str, value: float | None, metric: str, final_step: int | None,
                      failed: bool) -> None:
        run = self.get_run(run_id)
        run.set_tags({"tfdag.tune.state": state.lower()})
        if value is not None and math.isfinite(value):
            run.log_metrics({metric: value}, prefix="tune.")
        run.end(RunStatus.FAILED if failed else RunStatus.FINISHED)

    def log_study(self, run_id: str, study: Any, space: Mapping[str, Any], metric: str,
                  best_params: Mapping[str, Any] | None) -> None:
        run = self.get_run(run_id)
        run.log_artifacts({"tune/space.json": json.dumps(space, default=str)})
        if best_params:
            run.log_params({f"best.{k}": v for k, v in best_params.items()})
