"""Metrics sinks (MLflow, in-memory, no-op) and the MLflow run of a pipeline: params, artifacts, the registered model."""

from __future__ import annotations

import contextlib
import enum
import logging
import math
import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from pydantic import BaseModel, ConfigDict

from pipeline_lib.core.errors import UserError

if TYPE_CHECKING:  # the heavy imports stay lazy: training imports this module for the sinks
    from pipeline_lib.config import PipelineConfig
    from pipeline_lib.data.manifest import Manifest
    from pipeline_lib.planning.sharding import ShardPlan
    from pipeline_lib.training.loop import TrainResult

logger = logging.getLogger(__name__)

SECRET_MARKERS = ("KEY", "SECRET", "TOKEN", "PASSWORD")
RUN_STATUSES = ("FINISHED", "FAILED", "KILLED")
MODEL_ARTIFACT_NAME = "model"
FINAL_METRIC_PREFIX = "final_eval_"
# MLflow's own limits (mlflow.utils.validation).
_MAX_PARAMS_PER_BATCH = 100
_MAX_METRICS_PER_BATCH = 1000
_MAX_BUFFERED_METRICS = 100_000
_MAX_PARAM_VALUE = 6000
_MAX_TAG_VALUE = 8000


class TrackingError(UserError, RuntimeError):
    """MLflow cannot be used as configured; the message names the value, where it came from and the fix."""


class MetricsSink(Protocol):
    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...

    def flush(self) -> None: ...


class NullSink:
    """Discards everything: what non-chief workers get."""

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        pass

    def flush(self) -> None:
        pass


class InMemorySink:
    """Keeps every logged value, for tests."""

    def __init__(self) -> None:
        self.history: list[tuple[int, dict[str, float]]] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.history.append((step, dict(metrics)))

    def flush(self) -> None:
        pass

    def series(self, name: str) -> list[tuple[int, float]]:
        return [(step, values[name]) for step, values in self.history if name in values]


def is_secret_name(name: str) -> bool:
    """True for names that look like credentials (they contain KEY, SECRET, TOKEN or PASSWORD)."""
    upper = name.upper()
    return any(marker in upper for marker in SECRET_MARKERS)


def _client(tracking_uri: str):
    from mlflow import MlflowClient

    _ensure_sqlite_dir(tracking_uri)
    return MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)


def _ensure_sqlite_dir(tracking_uri: str) -> None:
    if tracking_uri.startswith("sqlite:///"):
        directory = os.path.dirname(tracking_uri.removeprefix("sqlite:///"))
        if directory:
            os.makedirs(directory, exist_ok=True)


@contextlib.contextmanager
def _global_uri(tracking_uri: str) -> Iterator[None]:
    """MLflow's model logging reads the process-wide URIs; set them for the call only."""
    import mlflow
    from mlflow.tracking._model_registry import utils as registry_utils
    from mlflow.tracking._tracking_service import utils as tracking_utils

    # The raw module values, not get_*_uri(): "unset" must come back as unset, or the registry would stay
    # pinned to the default store instead of following each client's tracking URI.
    previous_tracking, previous_registry = tracking_utils._tracking_uri, registry_utils._registry_uri
    # set_tracking_uri also exports MLFLOW_TRACKING_URI (and the registry variable) to the environment, where
    # it would outlive this call and redirect every later pipeline in the process: restore those too.
    saved_env = {name: os.environ.get(name) for name in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")}
    mlflow.set_tracking_uri(tracking_uri)
    mlflow.set_registry_uri(tracking_uri)
    try:
        yield
    finally:
        tracking_utils._tracking_uri = previous_tracking
        registry_utils._registry_uri = previous_registry
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class MlflowSink:
    """A MetricsSink that buffers metrics and sends them to one MLflow run with batched `log_batch` calls."""

    def __init__(self, run_id: str, tracking_uri: str, flush_every: int = 50):
        if flush_every < 1:
            raise ValueError(f"flush_every ({flush_every}) must be ≥ 1")
        self.run_id = run_id
        self.tracking_uri = tracking_uri
        self.flush_every = flush_every
        self._client = _client(tracking_uri)
        self._pending: list[Any] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        timestamp = int(time.time() * 1000)
        for name, value in metrics.items():
            self._pending.append(Metric(key=name, value=float(value), timestamp=timestamp, step=int(step)))
        if len(self._pending) >= self.flush_every:
            self.flush()

    def flush(self) -> None:
        """Send every buffered value; on a store error keep them for the next flush, so training goes on."""
        while self._pending:
            chunk = self._pending[:_MAX_METRICS_PER_BATCH]
            try:
                self._client.log_batch(self.run_id, metrics=chunk, synchronous=True)
            except Exception as error:  # noqa: BLE001 - a locked sqlite file or a server blip must not stop training
                dropped = max(0, len(self._pending) - _MAX_BUFFERED_METRICS)
                self._pending = self._pending[dropped:]
                logger.warning("MLflow run %s: %d metric value(s) not logged yet (%s); retrying at the next flush%s",
                               self.run_id, len(self._pending), error,
                               f", {dropped} oldest dropped" if dropped else "")
                return
            self._pending = self._pending[len(chunk):]


def create_sink(run_id: str | None, tracking_uri: str, flush_every: int = 50) -> MetricsSink:
    """An MlflowSink for a run id, a NullSink without one (tracking disabled)."""
    return MlflowSink(run_id, tracking_uri, flush_every) if run_id else NullSink()


def _get_or_create_experiment(client, config: PipelineConfig) -> str:
    from mlflow.exceptions import MlflowException

    name = config.tracking.experiment
    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        location = config.tracking.artifact_location or _default_artifact_location(config.mlflow_uri)
        try:
            return client.create_experiment(name, artifact_location=location)
        except MlflowException:
            # Another process created it in between.
            experiment = client.get_experiment_by_name(name)
            if experiment is None:
                raise
    if experiment.lifecycle_stage == "deleted":
        raise TrackingError(
            f"tracking.experiment {name!r} is deleted in the MLflow store {config.mlflow_uri}; restore it "
            f"(mlflow experiments restore --experiment-id {experiment.experiment_id}) or choose another name"
        )
    return experiment.experiment_id


def _default_artifact_location(tracking_uri: str) -> str | None:
    """Beside a sqlite store rather than MLflow's default of ./mlruns in whatever directory the process runs."""
    if tracking_uri.startswith("sqlite:///"):
        return os.path.join(os.path.dirname(tracking_uri.removeprefix("sqlite:///")), "mlartifacts")
    return None


def _clean_tags(tags: Mapping[str, Any] | None) -> dict[str, str]:
    cleaned = {}
    for name, value in (tags or {}).items():
        if is_secret_name(name):
            logger.warning("tag %s looks like a credential and is not logged", name)
            continue
        cleaned[name] = str(value)[:_MAX_TAG_VALUE]
    return cleaned


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
    client = _client(config.mlflow_uri)
    experiment_id = _get_or_create_experiment(client, config)
    quoted = run_name.replace("'", "\\'")
    existing = client.search_runs([experiment_id], filter_string=f"attributes.run_name = '{quoted}'",
                                  max_results=10)
    for run in existing:
        if run.info.status == "RUNNING":
            logger.info("reusing MLflow run %s (%s)", run.info.run_id, run_name)
            return run.info.run_id
    all_tags = {"tfdag.pipeline": config.name, "tfdag.config_hash": config.config_hash(), **_clean_tags(tags)}
    run = client.create_run(experiment_id, run_name=run_name, tags=all_tags)
    logger.info("MLflow run %s (%s) in experiment %r at %s", run.info.run_id, run_name,
                config.tracking.experiment, config.mlflow_uri)
    return run.info.run_id


def _param_value(value: Any) -> str:
    if isinstance(value, enum.Enum):
        value = value.value
    text = str(value)
    return text if len(text) <= _MAX_PARAM_VALUE else text[: _MAX_PARAM_VALUE - 3] + "..."


def log_params(run_id: str, tracking_uri: str, params: Mapping[str, Any]) -> None:
    """Log params in batches; names that look like credentials and dict values (options) are dropped.

    Logging the same value again is allowed (a retried task); MLflow rejects a changed value.
    """
    from mlflow.entities import Param

    entries = []
    for name, value in params.items():
        if is_secret_name(name) or isinstance(value, Mapping):
            logger.warning("param %s is not logged: credentials and option mappings never become params", name)
            continue
        entries.append(Param(name, _param_value(value)))
    client = _client(tracking_uri)
    for start in range(0, len(entries), _MAX_PARAMS_PER_BATCH):
        client.log_batch(run_id, params=entries[start:start + _MAX_PARAMS_PER_BATCH], synchronous=True)


def log_final_metrics(run_id: str, tracking_uri: str, metrics: Mapping[str, float], *, step: int = 0,
                      prefix: str = FINAL_METRIC_PREFIX) -> None:
    """Log the exported model's evaluation as `<prefix><name>` (NaN values, such as an undefined AUC, skipped)."""
    from mlflow.entities import Metric

    timestamp = int(time.time() * 1000)
    entries = [Metric(f"{prefix}{name}", float(value), timestamp, step)
               for name, value in metrics.items() if not math.isnan(float(value))]
    _client(tracking_uri).log_batch(run_id, metrics=entries, synchronous=True)


def record_restart(run_id: str, tracking_uri: str, attempt: int, cause: str) -> None:
    """Count a training restart on the run: the `num_restarts` metric and the last cause as a tag."""
    client = _client(tracking_uri)
    client.log_metric(run_id, "num_restarts", float(attempt), step=int(attempt))
    client.set_tag(run_id, "tfdag.last_restart_cause", str(cause)[:_MAX_TAG_VALUE])


def _byte_size(count: int) -> str:
    return f"{count / 1e6:.1f} MB" if count >= 1e6 else f"{count} B"


def pipeline_params(config: PipelineConfig, train_result: TrainResult, plan: ShardPlan,
                    manifest: Manifest, versions: Mapping[str, str]) -> dict[str, Any]:
    """The params of a pipeline run, built from typed fields only, so no storage option or env value gets in.

    Args:
        config: the pipeline config.
        train_result: the chief's TrainResult (the strategy and batch sizes actually used).
        plan: the shard plan.
        manifest: the dataset manifest.
        versions: package versions, e.g. {"tensorflow": "2.21.0"} (a `_version` suffix is added when missing).

    Returns:
        A flat {name: value} mapping for `log_params`.
    """
    train = config.train
    files = {path for assignment in plan.assignments for path in assignment.files}
    params: dict[str, Any] = {
        "pipeline": config.name,
        "strategy": train_result.strategy,
        "strategy_reason": train_result.strategy_reason,
        "num_workers": train_result.num_workers,
        "num_replicas": train_result.num_replicas,
        "per_replica_batch_size": train_result.per_replica_batch_size,
        "global_batch_size": train_result.global_batch_size,
        "base_learning_rate": train_result.base_learning_rate,
        "scaled_learning_rate": train_result.scaled_learning_rate,
        "lr_scaling": train_result.lr_scaling,
        "warmup_steps": train.warmup_steps,
        "optimizer": train.optimizer,
        "epochs": plan.epochs,
        "steps_per_epoch": train_result.steps_per_epoch,
        "total_steps": train_result.total_steps,
        "seed": train.seed,
        "deterministic": train.deterministic,
        "mixed_precision": train.mixed_precision,
        "model_factory": config.model.factory,
        "model_task": config.model.task.value,
        "config_hash": config.config_hash(),
        "data_fingerprint": manifest.fingerprint,
        "data_content_hash": manifest.content_hash(),
        "num_train_records": manifest.num_records("train"),
        "num_eval_records": manifest.num_records("eval"),
        "shard_policy": plan.policy.value,
        "shard_num_files": len(files) or len(manifest.shards_for("train")),
        "shard_imbalance_ratio": round(plan.imbalance_ratio, 4),
        "shard_replicas_per_worker": plan.replicas_per_worker,
        "shard_plan": (f"{plan.policy.value} over {plan.num_workers} worker(s), "
                       f"{len(files) or len(manifest.shards_for('train'))} file(s), "
                       f"imbalance {plan.imbalance_ratio:.3f}, {len(plan.warnings)} warning(s)"),
    }
    for package, version in versions.items():
        name = package if package.endswith("_version") else f"{package}_version"
        params[name] = version
    return params


def _stage_artifact(name: str, value: str | bytes, staging: str) -> None:
    target = os.path.join(staging, *name.strip("/").split("/"))
    parent = os.path.dirname(target)
    if isinstance(value, bytes):
        os.makedirs(parent, exist_ok=True)
        with open(target, "wb") as handle:
            handle.write(value)
        return
    if "\n" not in value and len(value) < 4096:
        from pipeline_lib.core import storage

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
    client = _client(tracking_uri)
    with tempfile.TemporaryDirectory(prefix="tfdag-artifacts-") as staging:
        for name, value in files.items():
            _stage_artifact(name, value, staging)
        client.log_artifacts(run_id, staging)
    logger.info("logged %d artifact(s) to MLflow run %s", len(files), run_id)


class ModelVersionInfo(BaseModel):
    """A model version in the MLflow registry."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    version: int
    model_uri: str  # models:/<name>/<version>
    logged_model_uri: str  # the run's logged model
    run_id: str
    flavor: str  # "keras" or "python_function"


_PYFUNC_CODE = '''"""tfdag: a Keras 3 model taking a dict of tensors (string inputs included), served through pyfunc."""
import keras
import mlflow
import numpy as np
import pandas as pd
import tensorflow as tf


class KerasDictModel(mlflow.pyfunc.PythonModel):
    def load_context(self, context):
        self.model = keras.saving.load_model(context.artifacts["keras_model"], compile=False)

    def predict(self, context, model_input, params=None):
        if isinstance(model_input, pd.DataFrame):
            model_input = {name: np.stack(model_input[name].to_numpy()) for name in model_input.columns}
        inputs = {name: tf.convert_to_tensor(value) for name, value in model_input.items()}
        return keras.ops.convert_to_numpy(self.model(inputs, training=False))


mlflow.models.set_model(KerasDictModel())
'''


def example_batch(manifest: Manifest, num_rows: int = 5,
                  storage_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The first rows of the eval split (train when there is none) as numpy model inputs."""
    from pipeline_lib.training import input_pipeline, staging

    split = "eval" if manifest.num_records("eval") else "train"
    manifest = staging.stage_split(manifest, split, storage_options=dict(storage_options or {}))
    dataset = input_pipeline.create_dataset(manifest, split, num_rows)
    inputs, _labels = next(iter(dataset))
    return {name: tensor.numpy() for name, tensor in inputs.items()}


def log_and_register_model(run_id: str, tracking_uri: str, keras_path: str, registered_name: str,
                           example_input: Manifest | Mapping[str, Any], *,
                           tags: Mapping[str, Any] | None = None,
                           storage_options: Mapping[str, Any] | None = None) -> ModelVersionInfo:
    """Log the exported model to the run with a signature inferred from an example batch, and register it.

    Numeric-only models use MLflow's `keras` flavor (Keras 3 on TensorFlow). Keras 3's `predict` rejects
    string arrays, so a model with string inputs is logged as a models-from-code pyfunc that calls the
    model on tensors; both load back with `mlflow.pyfunc.load_model(uri).predict({name: array})`.

    Args:
        run_id: the MLflow run.
        tracking_uri: the MLflow store (also the registry).
        keras_path: the exported `.keras` file (local path or fsspec URI).
        registered_name: `tracking.registered_model`.
        example_input: a dict of numpy inputs, or a Manifest to take the first eval rows from.
        tags: tags for the model version (credential-like names are dropped).

    Returns:
        The registered name and version.
    """
    import keras
    import mlflow
    import numpy as np
    import tensorflow as tf
    from mlflow.models import Model, infer_signature

    from pipeline_lib.evaluation import metrics as evaluation

    if hasattr(example_input, "feature_schema"):
        example = example_batch(example_input, storage_options=storage_options)  # type: ignore[arg-type]
    else:
        example = {name: np.asarray(value) for name, value in dict(example_input).items()}
    model = evaluation.load_model(keras_path)
    outputs = keras.ops.convert_to_numpy(model({k: tf.convert_to_tensor(v) for k, v in example.items()},
                                               training=False))
    signature = infer_signature(example, outputs)
    has_strings = any(value.dtype.kind in "OSU" for value in example.values())
    requirements = [f"tensorflow=={tf.__version__}", f"keras=={keras.__version__}", f"mlflow=={mlflow.__version__}"]
    client = _client(tracking_uri)
    experiment_id = client.get_run(run_id).info.experiment_id
    with contextlib.ExitStack() as stack:
        stack.enter_context(_global_uri(tracking_uri))
        # Created first in the run's experiment: without an active run MLflow would file the model under the
        # default experiment (and its ./mlruns artifact root). Passing run_id, not an active run, keeps the
        # pipeline's run RUNNING after logging.
        logged = mlflow.initialize_logged_model(name=MODEL_ARTIFACT_NAME, source_run_id=run_id,
                                                experiment_id=experiment_id)
        common = {"artifact_path": None, "name": MODEL_ARTIFACT_NAME, "run_id": run_id, "model_id": logged.model_id,
                  "signature": signature, "registered_model_name": registered_name,
                  "pip_requirements": requirements}
        try:
            if has_strings:
                tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="tfdag-model-"))
                code_path = os.path.join(tmp, "keras_dict_model.py")
                with open(code_path, "w") as handle:
                    handle.write(_PYFUNC_CODE)
                local_keras = os.path.join(tmp, "model.keras")
                model.save(local_keras)
                info = Model.log(flavor=mlflow.pyfunc, python_model=code_path,
                                 artifacts={"keras_model": local_keras}, **common)
                flavor = "python_function"
            else:
                info = Model.log(flavor=mlflow.keras, model=model, **common)
                flavor = "keras"
        except Exception:
            from mlflow.entities import LoggedModelStatus

            client.finalize_logged_model(logged.model_id, LoggedModelStatus.FAILED)
            raise
    version = int(info.registered_model_version)
    for name, value in _clean_tags(tags).items():
        client.set_model_version_tag(registered_name, str(version), name, value)
    logger.info("registered %s version %d from run %s (%s flavor)", registered_name, version, run_id, flavor)
    return ModelVersionInfo(name=registered_name, version=version, model_uri=f"models:/{registered_name}/{version}",
                            logged_model_uri=info.model_uri, run_id=run_id, flavor=flavor)


def finish_run(run_id: str, tracking_uri: str, status: str = "FINISHED") -> None:
    """End the run as FINISHED, FAILED or KILLED.

    Raises:
        TrackingError: for any other status.
    """
    status = status.upper()
    if status not in RUN_STATUSES:
        raise TrackingError(f"run status {status!r} is not one of {list(RUN_STATUSES)}")
    _client(tracking_uri).set_terminated(run_id, status=status)


def run_ui_url(tracking_uri: str, run_id: str) -> str | None:
    """The MLflow UI page of a run when the store is an MLflow server (http/https), else None."""
    if not tracking_uri.startswith(("http://", "https://")):
        return None
    experiment_id = _client(tracking_uri).get_run(run_id).info.experiment_id
    return f"{tracking_uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"
