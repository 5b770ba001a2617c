"""Logging the exported model to its MLflow run and registering it: the keras flavor or a pyfunc for string inputs."""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Mapping
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from pydantic import BaseModel, ConfigDict

from pipeline_lib.data.manifest import Manifest
from pipeline_lib.evaluation.metrics import load_model
from pipeline_lib.tracking.client import clean_tags, create_client, global_tracking_uri
from pipeline_lib.training import input_pipeline, staging

logger = logging.getLogger(__name__)

MODEL_ARTIFACT_NAME = "model"


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


@contextlib.contextmanager
def _no_progress_bars():
    was_interactive = keras.config.is_interactive_logging_enabled()
    keras.config.disable_interactive_logging()
    try:
        yield
    finally:
        if was_interactive:
            keras.config.enable_interactive_logging()


def _keras_flavor() -> Any:
    """`mlflow.keras` for `Model.log`, with its model directory created first: MLflow 3.17's keras `save_model`
    writes the input example before it creates that directory (FileNotFoundError on input_example.json)."""
    import types

    import mlflow.keras

    def save_model(path: str, **kwargs: Any) -> None:
        os.makedirs(path, exist_ok=True)
        mlflow.keras.save_model(path=path, **kwargs)

    return types.SimpleNamespace(__name__=mlflow.keras.__name__, save_model=save_model)


def example_batch(manifest: Manifest, num_rows: int = 5,
                  storage_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The first rows of the eval split (train when there is none) as numpy model inputs."""
    split = "eval" if manifest.num_records("eval") else "train"
    manifest = staging.stage_split(manifest, split, storage_options=dict(storage_options or {}))
    dataset = input_pipeline.create_dataset(manifest, split, num_rows)
    inputs, _labels = next(iter(dataset))
    return {name: tensor.numpy() for name, tensor in inputs.items()}


def log_and_register_model(run_id: str, tracking_uri: str, keras_path: str, registered_name: str | None,
                           example_input: Manifest | Mapping[str, Any], *,
                           tags: Mapping[str, Any] | None = None,
                           storage_options: Mapping[str, Any] | None = None,
                           metrics: Mapping[str, float] | None = None,
                           metric_prefix: str = "final_eval_") -> ModelVersionInfo | None:
    """Log the exported model to the run with a signature inferred from an example batch, and register it.

    With `registered_name` None the model is only logged to the run (a model the gate did not bless).

    Numeric-only models use MLflow's `keras` flavor (Keras 3 on TensorFlow). Keras 3's `predict` rejects
    string arrays, so a model with string inputs is logged as a models-from-code pyfunc that calls the
    model on tensors; both load back with `mlflow.pyfunc.load_model(uri).predict({name: array})`.

    Args:
        run_id: the MLflow run.
        tracking_uri: the MLflow store (also the registry).
        keras_path: the exported `.keras` file (local path or fsspec URI).
        registered_name: `tracking.registered_model`, or None to log without registering.
        example_input: a dict of numpy inputs, or a Manifest to take the first eval rows from.
        tags: tags for the model version (credential-like names are dropped).
        metrics: the model's evaluation, logged to the run as `<metric_prefix><name>` and linked to the logged model
            (MLflow 3 shows them with the model, and on its registered version).

    Returns:
        The registered name and version; None when not registered.
    """
    import mlflow
    from mlflow.models import Model, infer_signature

    if hasattr(example_input, "feature_schema"):
        example = example_batch(example_input, storage_options=storage_options)  # type: ignore[arg-type]
    else:
        example = {name: np.asarray(value) for name, value in dict(example_input).items()}
    model = load_model(keras_path)
    outputs = keras.ops.convert_to_numpy(model({k: tf.convert_to_tensor(v) for k, v in example.items()},
                                               training=False))
    signature = infer_signature(example, outputs)
    has_strings = any(value.dtype.kind in "OSU" for value in example.values())
    requirements = [f"tensorflow=={tf.__version__}", f"keras=={keras.__version__}", f"mlflow=={mlflow.__version__}"]
    client = create_client(tracking_uri)
    experiment_id = client.get_run(run_id).info.experiment_id
    with contextlib.ExitStack() as stack:
        stack.enter_context(global_tracking_uri(tracking_uri))
        stack.enter_context(_no_progress_bars())  # MLflow predicts on the input example to check it
        # Created first in the run's experiment: without an active run MLflow would file the model under the
        # default experiment (and its ./mlruns artifact root). Passing run_id, not an active run, keeps the
        # pipeline's run RUNNING after logging.
        logged = mlflow.initialize_logged_model(name=MODEL_ARTIFACT_NAME, source_run_id=run_id,
                                                experiment_id=experiment_id)
        common = {"artifact_path": None, "name": MODEL_ARTIFACT_NAME, "run_id": run_id, "model_id": logged.model_id,
                  "signature": signature, "input_example": example, "registered_model_name": registered_name,
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
                info = Model.log(flavor=_keras_flavor(), model=model, **common)
                flavor = "keras"
        except Exception:
            from mlflow.entities import LoggedModelStatus

            client.finalize_logged_model(logged.model_id, LoggedModelStatus.FAILED)
            raise
    if metrics:
        _log_model_metrics(client, run_id, logged.model_id, metrics, metric_prefix)
    if registered_name is None:
        logger.info("logged the model to run %s (%s flavor), not registered", run_id, flavor)
        return None
    version = int(info.registered_model_version)
    for name, value in clean_tags(tags).items():
        client.set_model_version_tag(registered_name, str(version), name, value)
    logger.info("registered %s version %d from run %s (%s flavor)", registered_name, version, run_id, flavor)
    return ModelVersionInfo(name=registered_name, version=version, model_uri=f"models:/{registered_name}/{version}",
                            logged_model_uri=info.model_uri, run_id=run_id, flavor=flavor)


def _log_model_metrics(client, run_id: str, model_id: str, metrics: Mapping[str, float], prefix: str) -> None:
    import math
    import time

    from mlflow.entities import Metric

    timestamp = int(time.time() * 1000)
    entries = [Metric(f"{prefix}{name}", float(value), timestamp, 0, model_id=model_id)
               for name, value in metrics.items() if not math.isnan(float(value))]
    client.log_batch(run_id, metrics=entries, synchronous=True)
