"""Model logging and registration against a real sqlite store: the keras flavor, the pyfunc for string inputs."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import keras
import mlflow
import numpy as np
import pytest
import tensorflow as tf
from mlflow import MlflowClient

from pipeline_lib.data.manifest import (
    DType,
    FeatureSpec,
    Manifest,
    Schema,
    ShardInfo,
    SourceFingerprint,
)
from pipeline_lib.tracking import model_logging
from pipeline_lib.tracking import run as tracking
from pipeline_lib.training import input_pipeline, models
from tests.conftest import write_dataset
from tests.pipeline_lib.tracking.conftest import SECRET, tracking_config


def _write_numeric_dataset(root: str, num_rows: int = 24) -> Manifest:
    """A dataset of numeric features only (like digits): 3 floats and a 2-class label."""
    rng = np.random.default_rng(1)
    shards = []
    for split in ("train", "eval"):
        os.makedirs(os.path.join(root, split), exist_ok=True)
        relative = f"{split}/part-00000-of-00001.tfrecord"
        path = os.path.join(root, relative)
        with tf.io.TFRecordWriter(path) as writer:
            for _ in range(num_rows):
                x = rng.normal(size=3).astype(np.float32)
                feature = {"x": tf.train.Feature(float_list=tf.train.FloatList(value=x.tolist())),
                           "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[int(x[0] > 0)]))}
                writer.write(tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString())
        digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
        shards.append(ShardInfo(split=split, path=relative, num_records=num_rows, num_bytes=os.path.getsize(path),
                                sha256=digest))
    schema = Schema(features=(FeatureSpec(name="x", dtype=DType.FLOAT32, shape=(3,)),),
                    label=FeatureSpec(name="label", dtype=DType.INT64), num_classes=2)
    return Manifest(fingerprint="numeric", dataset_uri=root, feature_schema=schema, shards=tuple(shards),
                    source=SourceFingerprint(files=(), sha256="0" * 64))


def _save_model(config, manifest, path: str) -> keras.Model:
    model = models.create_model(config.model, manifest.feature_schema)
    model.save(path)
    return model


def _predictions(model, manifest):
    inputs, _ = next(iter(input_pipeline.create_dataset(manifest, "eval", 5)))
    numpy_inputs = {k: v.numpy() for k, v in inputs.items()}
    return numpy_inputs, model(inputs, training=False).numpy()


@pytest.mark.slow
def test_numeric_model_is_logged_with_the_keras_flavor_and_registered(tmp_path, monkeypatch):
    manifest = _write_numeric_dataset(str(tmp_path / "data"))
    config = tracking_config(tmp_path)
    model = _save_model(config, manifest, str(tmp_path / "model.keras"))
    run_id = tracking.start_run(config, "register")
    env_before = os.environ.get("MLFLOW_TRACKING_URI")

    version = model_logging.log_and_register_model(run_id, config.mlflow_uri, str(tmp_path / "model.keras"), "tiny",
                                              manifest, tags={"tfdag_run_name": "register", "api_token": SECRET})
    second = model_logging.log_and_register_model(run_id, config.mlflow_uri, str(tmp_path / "model.keras"), "tiny",
                                             manifest)
    # Model logging must not leave MLFLOW_TRACKING_URI behind to redirect the next pipeline in this process.
    assert os.environ.get("MLFLOW_TRACKING_URI") == env_before

    assert (version.name, version.version, version.flavor) == ("tiny", 1, "keras")
    assert second.version == 2
    client = MlflowClient(config.mlflow_uri)
    registered = client.get_model_version("tiny", "1")
    assert registered.run_id == run_id
    assert registered.tags == {"tfdag_run_name": "register"}
    run = client.get_run(run_id)
    assert run.info.status == "RUNNING"  # logging the model does not end the run
    # Filed under the run's experiment and its artifact root, not MLflow's default experiment in ./mlruns.
    logged = client.get_logged_model(version.logged_model_uri.removeprefix("models:/"))
    assert logged.experiment_id == run.info.experiment_id and logged.source_run_id == run_id
    assert logged.artifact_location.startswith(str(tmp_path))
    inputs, expected = _predictions(model, manifest)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", config.mlflow_uri)  # models:/ URIs resolve through it
    loaded = mlflow.pyfunc.load_model(version.model_uri)
    assert [s.name for s in loaded.metadata.get_input_schema().inputs] == ["numeric"]
    np.testing.assert_allclose(np.asarray(loaded.predict(inputs)), expected, rtol=1e-5, atol=1e-6)
    assert isinstance(mlflow.keras.load_model(version.model_uri), keras.Model)


@pytest.mark.slow
def test_model_with_string_inputs_is_logged_as_pyfunc_and_predicts_alike(tmp_path, monkeypatch):
    manifest = write_dataset(str(tmp_path / "data"), num_train=8, num_eval=8)
    config = tracking_config(tmp_path)
    model = _save_model(config, manifest, str(tmp_path / "model.keras"))
    run_id = tracking.start_run(config, "strings")

    version = model_logging.log_and_register_model(run_id, config.mlflow_uri, str(tmp_path / "model.keras"), "tiny",
                                              manifest)

    assert version.flavor == "python_function"
    inputs, expected = _predictions(model, manifest)
    assert inputs["color"].dtype == object
    monkeypatch.setenv("MLFLOW_TRACKING_URI", config.mlflow_uri)  # models:/ URIs resolve through it
    loaded = mlflow.pyfunc.load_model(f"models:/tiny/{version.version}")
    assert sorted(s.name for s in loaded.metadata.get_input_schema().inputs) == ["color", "numeric"]
    np.testing.assert_allclose(np.asarray(loaded.predict(inputs)), expected, rtol=1e-5, atol=1e-6)
