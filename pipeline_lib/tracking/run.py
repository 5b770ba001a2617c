"""The MLflow run of one pipeline run: its experiment, start and end, params, final metrics, blessing, artifacts,
restarts."""

from __future__ import annotations

import enum
import logging
import math
import os
import shutil
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import Any

from pipeline_lib.config import PipelineConfig
from pipeline_lib.core import storage
from pipeline_lib.core.secrets import is_secret_name, mask_url_passwords
from pipeline_lib.evaluation.report import GateDecision
from pipeline_lib.evaluation.slicing import SliceResult
from pipeline_lib.serving.validation import ModelValidation
from pipeline_lib.tracking import lineage
from pipeline_lib.tracking.client import (
    MAX_TAG_VALUE,
    clean_tags,
    create_client,
    masked_run_links,
)
from pipeline_lib.tracking.records import (
    FINAL_METRIC_PREFIX,
    RunStatus,
    TrackingError,
    run_status,
)

logger = logging.getLogger(__name__)

# The stage that raised, on a run that ended FAILED or KILLED.
FAILED_STAGE_TAG = "tfdag.failed_stage"
# The gate's decision on the run's model: "true" or "false", and why.
BLESSED_RUN_TAG = "tfdag.blessed"
GATE_REASON_RUN_TAG = "tfdag.gate_reason"
# The model check before registration (serving.validation): "true" or "false", and its reason; the per-loader
# detail is the artifact MODEL_VALIDATION_ARTIFACT (and its .md beside it).
MODEL_VALIDATED_RUN_TAG = "tfdag.model_validated"
MODEL_VALIDATION_REASON_RUN_TAG = "tfdag.model_validation"
MODEL_VALIDATION_ARTIFACT = "evaluation/model_validation.json"
RESTART_TAG_PREFIX = "tfdag.restart."  # one tag per restart: its cause and the step it resumed from
RESIZE_TAG_PREFIX = "tfdag.resize."  # one tag per resize of an elastic run: from → to, at step, reason
WORKERS_METRIC = "workers"  # an elastic run's training workers, by step
# MLflow's own limits (mlflow.utils.validation).
_MAX_PARAMS_PER_BATCH = 100
_MAX_METRICS_PER_BATCH = 1000
_MAX_PARAM_VALUE = 6000


def _get_or_create_experiment(client, config: PipelineConfig) -> str:
    from mlflow.exceptions import MlflowException

    name = config.tracking.experiment
    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        location = (storage.mlflow_artifact_uri(config.tracking.artifact_location) if config.tracking.artifact_location
                    else _default_artifact_location(config.mlflow_uri))
        try:
            return client.create_experiment(name, artifact_location=location,
                                            tags={lineage.EXPERIMENT_KIND_TAG: lineage.MODEL_TRAINING_KIND})
        except MlflowException:
            # Another process created it in between.
            experiment = client.get_experiment_by_name(name)
            if experiment is None:
                raise
    if experiment.lifecycle_stage == "deleted":
        raise TrackingError(
            f"tracking.experiment {name!r} is deleted in the MLflow store {config.mlflow_uri_shown}; restore it "
            f"(mlflow experiments restore --experiment-id {experiment.experiment_id}) or choose another name"
        )
    lineage.mark_model_training(client, experiment.experiment_id)
    return experiment.experiment_id


def _default_artifact_location(tracking_uri: str) -> str | None:
    """Beside a sqlite store rather than MLflow's default of ./mlruns in whatever directory the process runs."""
    if tracking_uri.startswith("sqlite:///"):
        return os.path.join(os.path.dirname(tracking_uri.removeprefix("sqlite:///")), "mlartifacts")
    return None


def start_run(config: PipelineConfig, run_name: str, *, tags: Mapping[str, Any] | None = None) -> str:
    """The MLflow run of one pipeline run: created once, found again on a retry.

    Creates `tracking.experiment` (at `tracking.artifact_location`) when it is missing.

    Args:
        config: the pipeline config (tracking section, mlflow_uri).
        run_name: the pipeline run's name; a RUNNING MLflow run of that name is reused.
        tags: extra run tags (names that look like credentials are dropped).

    Returns:
        The MLflow run id (the chief gets it as MLFLOW_RUN_ID).

    Raises:
        TrackingError: when the experiment is deleted.
    """
    client = create_client(config.mlflow_uri)
    experiment_id = _get_or_create_experiment(client, config)
    quoted = run_name.replace("'", "\\'")
    existing = client.search_runs([experiment_id], filter_string=f"attributes.run_name = '{quoted}'",
                                  max_results=10)
    for run in existing:
        if run.info.status == "RUNNING":
            logger.info("reusing MLflow run %s (%s)", run.info.run_id, run_name)
            return run.info.run_id
    all_tags = {"tfdag.pipeline": config.name, "tfdag.config_hash": config.config_hash(), **clean_tags(tags)}
    run = client.create_run(experiment_id, run_name=run_name, tags=all_tags)
    logger.debug("MLflow run %s (%s) in experiment %r at %s", run.info.run_id, run_name,
                config.tracking.experiment, config.mlflow_uri_shown)
    return run.info.run_id


def finish_run(run_id: str, tracking_uri: str, status: RunStatus | str = RunStatus.FINISHED, *,
               failed_stage: str | None = None) -> None:
    """End the run as FINISHED, FAILED or KILLED, with its end time.

    Args:
        run_id: the MLflow run.
        tracking_uri: the MLflow store.
        status: how the run ended.
        failed_stage: the stage that raised, recorded as the `tfdag.failed_stage` tag.

    Raises:
        TrackingError: for a status other than FINISHED, FAILED or KILLED.
    """
    name = run_status(status).value
    client = create_client(tracking_uri)
    if failed_stage:
        client.set_tag(run_id, FAILED_STAGE_TAG, failed_stage[:MAX_TAG_VALUE])
    with masked_run_links(tracking_uri):
        client.set_terminated(run_id, status=name)
    logger.debug("MLflow run %s ended %s%s", run_id, name, f" in stage {failed_stage}" if failed_stage else "")


def reopen_run(run_id: str, tracking_uri: str) -> None:
    """Set an ended run back to RUNNING (a resumed pipeline run), its failed stage cleared."""
    client = create_client(tracking_uri)
    if FAILED_STAGE_TAG in client.get_run(run_id).data.tags:
        client.delete_tag(run_id, FAILED_STAGE_TAG)
    client.update_run(run_id, status="RUNNING")
    logger.debug("MLflow run %s reopened", run_id)


def _param_value(value: Any) -> str:
    if isinstance(value, enum.Enum):
        value = value.value
    text = mask_url_passwords(str(value))
    return text if len(text) <= _MAX_PARAM_VALUE else text[: _MAX_PARAM_VALUE - 3] + "..."


def log_params(run_id: str, tracking_uri: str, params: Mapping[str, Any]) -> None:
    """Log params in batches; names that look like credentials and dict values (options) are dropped.

    A param the run already has with the same value is not logged again (a retried task, a resumed run); MLflow
    rejects a changed value.
    """
    from mlflow.entities import Param

    client = create_client(tracking_uri)
    logged = client.get_run(run_id).data.params
    entries = []
    for name, value in params.items():
        if is_secret_name(name) or isinstance(value, Mapping):
            logger.warning("param %s is not logged: credentials and option mappings never become params", name)
            continue
        if logged.get(name) != _param_value(value):
            entries.append(Param(name, _param_value(value)))
    for start in range(0, len(entries), _MAX_PARAMS_PER_BATCH):
        client.log_batch(run_id, params=entries[start:start + _MAX_PARAMS_PER_BATCH], synchronous=True)


def log_final_metrics(run_id: str, tracking_uri: str, metrics: Mapping[str, float], *, step: int = 0,
                      prefix: str = FINAL_METRIC_PREFIX) -> None:
    """Log the exported model's evaluation as `<prefix><name>` (NaN values, such as an undefined AUC, skipped)."""
    from mlflow.entities import Metric

    timestamp = int(time.time() * 1000)
    entries = [Metric(f"{prefix}{name}", float(value), timestamp, step)
               for name, value in metrics.items() if not math.isnan(float(value))]
    create_client(tracking_uri).log_batch(run_id, metrics=entries, synchronous=True)


def log_slice_metrics(run_id: str, tracking_uri: str, slices: Sequence[SliceResult]) -> None:
    """Each slice's metrics as `slice.<feature>:<value>.<metric>` (MLflow names allow no `=`), and its example
    count as `slice.<feature>:<value>.num_examples`."""
    from mlflow.entities import Metric

    timestamp = int(time.time() * 1000)
    entries = []
    for result in slices:
        values = {**result.metrics, "num_examples": float(result.num_examples)}
        entries += [Metric(result.metric_name(name), float(value), timestamp, 0)
                    for name, value in values.items() if not math.isnan(float(value))]
    client = create_client(tracking_uri)
    for start in range(0, len(entries), _MAX_METRICS_PER_BATCH):
        client.log_batch(run_id, metrics=entries[start:start + _MAX_METRICS_PER_BATCH], synchronous=True)


def record_blessing(run_id: str, tracking_uri: str, decision: GateDecision) -> None:
    """Tag the run `tfdag.blessed` (true/false) with the gate's reason; a run that is not blessed still ends
    FINISHED."""
    client = create_client(tracking_uri)
    client.set_tag(run_id, BLESSED_RUN_TAG, "true" if decision.blessed else "false")
    client.set_tag(run_id, GATE_REASON_RUN_TAG, decision.reason[:MAX_TAG_VALUE])


def record_model_validation(run_id: str, tracking_uri: str, validation: ModelValidation) -> None:
    """Tag the run `tfdag.model_validated` (true/false) with the check's reason, and log each loader's check as
    `evaluation/model_validation.json` and `.md`."""
    client = create_client(tracking_uri)
    client.set_tag(run_id, MODEL_VALIDATED_RUN_TAG, "true" if validation.passed else "false")
    client.set_tag(run_id, MODEL_VALIDATION_REASON_RUN_TAG, validation.reason[:MAX_TAG_VALUE])
    log_artifacts(run_id, tracking_uri, {MODEL_VALIDATION_ARTIFACT: validation.model_dump_json(indent=2),
                                         MODEL_VALIDATION_ARTIFACT.replace(".json", ".md"): validation.to_markdown()})


def record_restart(run_id: str, tracking_uri: str, attempt: int, cause: str) -> None:
    """Count a training restart on the run: the `num_restarts` metric, its story (cause and the step it resumed
    from) as the tag `tfdag.restart.<attempt>`, and the latest as `tfdag.last_restart_cause`."""
    client = create_client(tracking_uri)
    client.log_metric(run_id, "num_restarts", float(attempt), step=int(attempt))
    client.set_tag(run_id, f"{RESTART_TAG_PREFIX}{int(attempt)}", str(cause)[:MAX_TAG_VALUE])
    client.set_tag(run_id, "tfdag.last_restart_cause", str(cause)[:MAX_TAG_VALUE])


def record_workers(run_id: str, tracking_uri: str, workers: int, step: int) -> None:
    """An elastic run's worker count from `step` on: the `workers` metric."""
    create_client(tracking_uri).log_metric(run_id, WORKERS_METRIC, float(workers), step=int(step))


def record_resize(run_id: str, tracking_uri: str, number: int, story: str, to_workers: int, step: int) -> None:
    """An elastic run's resize `number`: the tag `tfdag.resize.<n>` (its story: from → to, at step, reason) and the
    `workers` metric at the step the resized group resumed from."""
    create_client(tracking_uri).set_tag(run_id, f"{RESIZE_TAG_PREFIX}{int(number)}", story[:MAX_TAG_VALUE])
    record_workers(run_id, tracking_uri, to_workers, step)


def _stage_artifact(name: str, value: str | bytes, staging: str) -> None:
    target = os.path.join(staging, *name.strip("/").split("/"))
    parent = os.path.dirname(target)
    if isinstance(value, bytes):
        os.makedirs(parent, exist_ok=True)
        with open(target, "wb") as handle:
            handle.write(value)
        return
    if "\n" not in value and len(value) < 4096:
        if "://" in value and not value.startswith("file://"):
            fs, path = storage.get_fs(value)
            if fs.exists(path):
                os.makedirs(parent, exist_ok=True)
                fs.get(path, target, recursive=fs.isdir(path))
                return
        elif os.path.exists(storage.local_path(value)):
            source = storage.local_path(value)
            os.makedirs(parent, exist_ok=True)
            if os.path.isdir(source):
                shutil.copytree(source, target, dirs_exist_ok=True)
            else:
                shutil.copyfile(source, target)
            return
        if value.startswith(("/", "./", "file://")) or "://" in value:
            # A path that was never written (no TensorBoard events, say): nothing to upload.
            logger.warning("artifact %s: %s does not exist; skipped", name, value)
            return
    os.makedirs(parent, exist_ok=True)
    with open(target, "w", encoding="utf-8") as handle:
        handle.write(value)


def log_artifacts(run_id: str, tracking_uri: str, files: Mapping[str, str | bytes]) -> None:
    """Upload artifacts to the run, each under its artifact path (the key).

    A bytes value is the file's content; a str value naming an existing file or directory (local or an
    fsspec URI, such as the TensorBoard directory) is copied from there; any other str is the text content.
    """
    client = create_client(tracking_uri)
    with tempfile.TemporaryDirectory(prefix="tfdag-artifacts-") as staging:
        for name, value in files.items():
            _stage_artifact(name, value, staging)
        client.log_artifacts(run_id, staging)
    logger.info("logged %d artifact(s) to MLflow run %s", len(files), run_id)


def read_artifact(run_id: str, tracking_uri: str, path: str) -> bytes:
    """The content of the run's artifact file `path`."""
    client = create_client(tracking_uri)
    with tempfile.TemporaryDirectory(prefix="tfdag-artifact-") as into, \
            open(client.download_artifacts(run_id, path, into), "rb") as handle:
        return handle.read()


def run_ui_url(tracking_uri: str, run_id: str) -> str | None:
    """The MLflow UI page of a run when the store is an MLflow server (http/https), else None; opened in MLflow's
    model-training view (the UI's default is its GenAI view)."""
    if not tracking_uri.startswith(("http://", "https://")):
        return None
    experiment_id = create_client(tracking_uri).get_run(run_id).info.experiment_id
    # A link is shown and stored (a Prefect artifact): a password in the URI is masked.
    return f"{mask_url_passwords(tracking_uri).rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}?{lineage.MODEL_TRAINING_VIEW}"
