"""Logging the exported model to its MLflow run as a self-contained pyfunc on raw rows, and registering it."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import tempfile
import threading
from collections.abc import Mapping
from typing import Any

import keras
import numpy as np
import pandas as pd
import tensorflow as tf

from pipeline_lib.core import storage
from pipeline_lib.data import tfdag_instants
from pipeline_lib.data.manifest import DType, FeatureSpec, Manifest, Schema, TimeKind
from pipeline_lib.serving import rows, tfdag_scoring
from pipeline_lib.tracking.client import clean_tags, create_client, global_tracking_uri
from pipeline_lib.tracking.records import LoggedModel, ModelVersionInfo

logger = logging.getLogger(__name__)

MODEL_ARTIFACT_NAME = "model"


# The models-from-code script MLflow runs to build the pyfunc: `tfdag_scoring` (and `tfdag_instants`, which it
# imports) ship beside it in `code_paths`.
_PYFUNC_SCRIPT = '''"""tfdag: the exported SavedModel on raw table rows (tfdag_scoring ships with the model)."""
import mlflow

try:
    from tfdag_scoring import TfdagModel  # where the model is loaded: shipped in code_paths
except ImportError:  # where tfdag logs it
    from pipeline_lib.serving.tfdag_scoring import TfdagModel

mlflow.models.set_model(TfdagModel())
'''


@contextlib.contextmanager
def _no_progress_bars():
    was_interactive = keras.config.is_interactive_logging_enabled()
    keras.config.disable_interactive_logging()
    try:
        yield
    finally:
        if was_interactive:
            keras.config.enable_interactive_logging()


def warm_up() -> None:
    """Check `requirements()` against this environment on a background thread now, as logging the model does
    first: MLflow maps every installed distribution to its modules once a process (a scan of their files), so the
    `log_model` that follows finds the map made. Returns at once; a failure here is left to `log_model` to meet."""
    def check() -> None:
        with contextlib.suppress(Exception):
            from mlflow.utils.requirements_utils import (
                warn_dependency_requirement_mismatches,
            )

            warn_dependency_requirement_mismatches(requirements())

    threading.Thread(target=check, name="tfdag-model-log-warm-up", daemon=True).start()


def requirements() -> list[str]:
    """What the logged model needs to load and predict: the versions tfdag trained it with, nothing of tfdag."""
    import mlflow

    return [f"tensorflow=={tf.__version__}", f"mlflow=={mlflow.__version__}", f"pandas=={pd.__version__}",
            f"numpy=={np.__version__}"]


def _column_type(spec: FeatureSpec):
    from mlflow.types.schema import Array

    if spec.time is not None:
        # MLflow's own check of a datetime column (before tfdag_scoring sees it) takes timezone-naive datetimes,
        # dates and ISO 8601 strings without an offset: naive means UTC here, as it does to tfdag_scoring.
        return "datetime"
    kind = "string" if spec.dtype == DType.STRING else "double"
    return Array(kind) if spec.shape else kind


def model_signature(schema: Schema, outputs: pd.DataFrame):
    """Inputs: the table's columns with their types (missing values allowed); outputs: the prediction frame."""
    from mlflow.models import ModelSignature
    from mlflow.types.schema import ColSpec
    from mlflow.types.schema import Schema as ColumnSchema

    # A vector column is not `required`: MLflow refuses a None cell (a missing vector, which the model takes as all
    # NaN) in a required Array column. Without it, an absent vector column is named by tfdag_scoring's error instead.
    inputs = ColumnSchema([ColSpec(_column_type(spec), spec.name, required=not spec.shape)
                           for spec in schema.features])
    kinds = {"O": "string", "U": "string", "i": "long", "f": "double"}
    columns = [ColSpec("float" if outputs[name].dtype == np.float32 else kinds[outputs[name].dtype.kind], name)
               for name in outputs.columns]
    return ModelSignature(inputs=inputs, outputs=ColumnSchema(columns))


def _local_dir(uri: str, storage_options: Mapping[str, Any] | None, stack: contextlib.ExitStack) -> str:
    if storage.is_local(uri):
        return storage.local_path(uri)
    local = os.path.join(stack.enter_context(tempfile.TemporaryDirectory(prefix="tfdag-model-")),
                         os.path.basename(uri.rstrip("/")))
    fs, root = storage.get_fs(uri, storage_options)
    fs.get(root.rstrip("/") + "/", local, recursive=True)
    return local


def log_model(run_id: str, tracking_uri: str, saved_model_dir: str, keras_path: str | None,
              example_input: Manifest | pd.DataFrame, *,
              storage_options: Mapping[str, Any] | None = None,
              metrics: Mapping[str, float] | None = None,
              metric_prefix: str = "final_eval_") -> LoggedModel:
    """Log the export to the run as a self-contained pyfunc: raw rows in, predictions out.

    The model is the SavedModel (`serving.signatures`) called by `tfdag_scoring`, which ships with it
    (`code_paths`, with `tfdag_instants`): it loads with `mlflow.pyfunc.load_model` where tfdag is not installed, with only the
    recorded requirements. `model.keras` rides along for tfdag's own use (warm starts, champion checks).

    Args:
        run_id: the MLflow run.
        tracking_uri: the MLflow store.
        saved_model_dir: the export's SavedModel (local path or fsspec URI).
        keras_path: the export's `.keras` file, or None.
        example_input: raw rows (a DataFrame of the table's columns), or a Manifest to take its first eval rows.
        metrics: the model's evaluation, logged to the run as `<metric_prefix><name>` and linked to the model.

    Returns:
        The logged model, for `register_model` and `mlflow.pyfunc.load_model(model_uri)`.
    """
    import mlflow
    from mlflow.models import Model

    example = (rows.raw_rows(example_input, storage_options=storage_options)
               if isinstance(example_input, Manifest) else example_input)
    client = create_client(tracking_uri)
    experiment_id = client.get_run(run_id).info.experiment_id
    _fail_pending_models(client, experiment_id, run_id)
    with contextlib.ExitStack() as stack:
        saved_local = _local_dir(saved_model_dir, storage_options, stack)
        outputs = tfdag_scoring.Scorer(saved_local).predict(example)
        signature = model_signature(read_schema(saved_local), outputs)
        artifacts = {"saved_model": saved_local}
        if keras_path:
            artifacts["keras_model"] = _local_file(keras_path, storage_options, stack)
        stack.enter_context(global_tracking_uri(tracking_uri))
        stack.enter_context(_no_progress_bars())
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="tfdag-pyfunc-"))
        script = os.path.join(tmp, "tfdag_model.py")
        with open(script, "w") as handle:
            handle.write(_PYFUNC_SCRIPT)
        # Created first in the run's experiment: without an active run MLflow would file the model under the
        # default experiment (and its ./mlruns artifact root). Passing run_id, not an active run, keeps the
        # pipeline's run RUNNING after logging.
        logged = mlflow.initialize_logged_model(name=MODEL_ARTIFACT_NAME, source_run_id=run_id,
                                                experiment_id=experiment_id)
        try:
            Model.log(flavor=mlflow.pyfunc, python_model=script, artifacts=artifacts,
                      code_paths=[tfdag_scoring.__file__, tfdag_instants.__file__], artifact_path=None, name=MODEL_ARTIFACT_NAME,
                      run_id=run_id, model_id=logged.model_id, signature=signature, input_example=example,
                      pip_requirements=requirements())
        except Exception:
            from mlflow.entities import LoggedModelStatus

            client.finalize_logged_model(logged.model_id, LoggedModelStatus.FAILED)
            raise
    if metrics:
        _log_model_metrics(client, run_id, logged.model_id, metrics, metric_prefix)
    logger.info("logged the model to run %s as %s", run_id, f"models:/{logged.model_id}")
    return LoggedModel(model_uri=f"models:/{logged.model_id}", model_id=logged.model_id, run_id=run_id)


def _fail_pending_models(client, experiment_id: str, run_id: str) -> None:
    """A model of the run left PENDING (an attempt killed while logging it, which a resumed run logs again) is
    marked FAILED: the run ends with one READY model."""
    from mlflow.entities import LoggedModelStatus

    for model in client.search_logged_models(experiment_ids=[experiment_id],
                                             filter_string=f"source_run_id = '{run_id}'"):
        if model.status == LoggedModelStatus.PENDING:
            client.finalize_logged_model(model.model_id, LoggedModelStatus.FAILED)
            logger.info("model %s of run %s was left pending by an earlier attempt: marked failed", model.model_id,
                        run_id)


def read_schema(saved_model_dir: str) -> Schema:
    """The feature columns of an exported SavedModel (from `tfdag_serving.json`) as a Schema."""
    spec = tfdag_scoring.read_serving_spec(saved_model_dir)
    times = {kind.value for kind in TimeKind}
    features = tuple(FeatureSpec(name=c["name"], dtype=DType(c["source_dtype"]), shape=tuple(c["shape"]),
                                 time=TimeKind(c["dtype"]) if c["dtype"] in times else None,
                                 source_type=c.get("source_type") if c["dtype"] in times else None)
                     for c in spec["columns"])
    label = FeatureSpec(name=spec["label"]["name"], dtype=DType(spec["label"]["dtype"]))
    return Schema(features=features, label=label)


def _local_file(uri: str, storage_options: Mapping[str, Any] | None, stack: contextlib.ExitStack) -> str:
    if storage.is_local(uri):
        return storage.local_path(uri)
    local = os.path.join(stack.enter_context(tempfile.TemporaryDirectory(prefix="tfdag-model-")),
                         os.path.basename(uri))
    fs, path = storage.get_fs(uri, storage_options)
    fs.get(path, local)
    return local


def register_model(tracking_uri: str, logged: LoggedModel, registered_name: str, *,
                   tags: Mapping[str, Any] | None = None) -> ModelVersionInfo:
    """Register a logged model as the next version of `registered_name`, with tags (credential-like dropped).

    A run registers once: when a version of `registered_name` from the logged model's run exists (an attempt
    killed after registering, then resumed), that version is returned and none is added."""
    import mlflow

    client = create_client(tracking_uri)
    earlier = client.search_model_versions(f"name = '{registered_name}' and run_id = '{logged.run_id}'")
    if earlier:
        version = min(int(v.version) for v in earlier)
        logger.info("%s version %d is already registered from run %s", registered_name, version, logged.run_id)
        return ModelVersionInfo(name=registered_name, version=version,
                                model_uri=f"models:/{registered_name}/{version}", logged_model_uri=logged.model_uri,
                                run_id=logged.run_id, flavor=logged.flavor)
    # register_model prints "Successfully registered model ..." to stderr; the log line below says it once.
    with global_tracking_uri(tracking_uri), contextlib.redirect_stderr(io.StringIO()) as printed:
        version_info = mlflow.register_model(logged.model_uri, registered_name)
    logger.debug("mlflow.register_model: %s", printed.getvalue().strip())
    version = int(version_info.version)
    for name, value in clean_tags(tags).items():
        client.set_model_version_tag(registered_name, str(version), name, value)
    logger.info("registered %s version %d from run %s", registered_name, version, logged.run_id)
    return ModelVersionInfo(name=registered_name, version=version, model_uri=f"models:/{registered_name}/{version}",
                            logged_model_uri=logged.model_uri, run_id=logged.run_id, flavor=logged.flavor)


def log_and_register_model(run_id: str, tracking_uri: str, saved_model_dir: str, keras_path: str | None,
                           registered_name: str | None, example_input: Manifest | pd.DataFrame, *,
                           tags: Mapping[str, Any] | None = None,
                           storage_options: Mapping[str, Any] | None = None,
                           metrics: Mapping[str, float] | None = None,
                           metric_prefix: str = "final_eval_") -> ModelVersionInfo | None:
    """`log_model`, then `register_model` unless `registered_name` is None (a model the gate did not bless)."""
    logged = log_model(run_id, tracking_uri, saved_model_dir, keras_path, example_input,
                       storage_options=storage_options, metrics=metrics, metric_prefix=metric_prefix)
    if registered_name is None:
        return None
    return register_model(tracking_uri, logged, registered_name, tags=tags)


def _log_model_metrics(client, run_id: str, model_id: str, metrics: Mapping[str, float], prefix: str) -> None:
    import math
    import time

    from mlflow.entities import Metric

    timestamp = int(time.time() * 1000)
    entries = [Metric(f"{prefix}{name}", float(value), timestamp, 0, model_id=model_id)
               for name, value in metrics.items() if not math.isnan(float(value))]
    client.log_batch(run_id, metrics=entries, synchronous=True)
