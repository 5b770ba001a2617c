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

from pipeline_lib.config import Task
from pipeline_lib.data.manifest import (
    DType,
    FeatureSpec,
    Manifest,
    Schema,
    ShardInfo,
    SourceFingerprint,
)
from pipeline_lib.serving import rows, signatures, tfdag_scoring
from pipeline_lib.tracking import model_logging
from pipeline_lib.tracking import run as tracking
from pipeline_lib.training import models
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


def _export(config, manifest, tmp_path) -> tuple[keras.Model, str, str]:
    """A model of `manifest`'s schema saved the way consolidation exports it: model.keras and the SavedModel."""
    model = models.create_model(config.model, manifest.feature_schema)
    keras_path, saved_model_dir = str(tmp_path / "model.keras"), str(tmp_path / "saved_model")
    model.save(keras_path)
    signatures.export_saved_model(model, manifest.feature_schema, Task.CLASSIFICATION, saved_model_dir)
    return model, saved_model_dir, keras_path


def _expected_probabilities(model, manifest, frame):
    """The Keras model's class probabilities on the raw rows of `frame`, computed without the logged model."""
    scorer = tfdag_scoring.Scorer.__new__(tfdag_scoring.Scorer)  # only its column conversion
    scorer.columns = signatures.serving_spec(manifest.feature_schema, Task.CLASSIFICATION)["columns"]
    tensors = scorer.to_tensors(frame)
    names = signatures.input_names(manifest.feature_schema)
    columns = {names[c["name"]]: tf.constant(tensors[c["name"]]) for c in scorer.columns}
    logits = model(signatures.raw_to_model_inputs(manifest.feature_schema, columns), training=False)
    return tf.nn.softmax(logits).numpy()


@pytest.mark.slow
def test_numeric_model_is_logged_as_a_pyfunc_on_raw_columns_and_registered(tmp_path, monkeypatch):
    manifest = _write_numeric_dataset(str(tmp_path / "data"))
    config = tracking_config(tmp_path)
    model, saved_model_dir, keras_path = _export(config, manifest, tmp_path)
    run_id = tracking.start_run(config, "register")
    env_before = os.environ.get("MLFLOW_TRACKING_URI")

    version = model_logging.log_and_register_model(run_id, config.mlflow_uri, saved_model_dir, keras_path, "tiny",
                                                   manifest, tags={"tfdag_run_name": "register", "api_token": SECRET})
    second = model_logging.log_and_register_model(run_id, config.mlflow_uri, saved_model_dir, keras_path, "tiny",
                                                  manifest)
    # Model logging must not leave MLFLOW_TRACKING_URI behind to redirect the next pipeline in this process.
    assert os.environ.get("MLFLOW_TRACKING_URI") == env_before

    assert (version.name, version.version, version.flavor) == ("tiny", 1, "python_function")
    # A run registers once: logged again (a resumed run), its model keeps the version it has.
    assert second.version == 1
    client = MlflowClient(config.mlflow_uri)
    assert [int(v.version) for v in client.search_model_versions("name = 'tiny'")] == [1]
    registered = client.get_model_version("tiny", "1")
    assert registered.run_id == run_id
    assert registered.tags == {"tfdag_run_name": "register"}
    run = client.get_run(run_id)
    assert run.info.status == "RUNNING"  # logging the model does not end the run
    # Filed under the run's experiment and its artifact root, not MLflow's default experiment in ./mlruns.
    logged = client.get_logged_model(version.logged_model_uri.removeprefix("models:/"))
    assert logged.experiment_id == run.info.experiment_id and logged.source_run_id == run_id
    assert logged.artifact_location.startswith(str(tmp_path))
    frame = rows.raw_rows(manifest, 5)
    expected = _expected_probabilities(model, manifest, frame)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", config.mlflow_uri)  # models:/ URIs resolve through it
    loaded = mlflow.pyfunc.load_model(version.model_uri)
    # The table's own column (a 3-vector), not tfdag's packed "numeric" input.
    assert [s.name for s in loaded.metadata.get_input_schema().inputs] == ["x"]
    got = loaded.predict(frame)
    assert list(got.columns) == ["prediction", "probability_0", "probability_1"]
    np.testing.assert_allclose(got[["probability_0", "probability_1"]].to_numpy(), expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got["prediction"].to_numpy(), expected.argmax(axis=1))


@pytest.mark.slow
def test_model_with_string_inputs_takes_raw_rows_with_missing_cells(tmp_path, monkeypatch):
    manifest = write_dataset(str(tmp_path / "data"), num_train=8, num_eval=8)
    config = tracking_config(tmp_path)
    model, saved_model_dir, keras_path = _export(config, manifest, tmp_path)
    run_id = tracking.start_run(config, "strings")

    version = model_logging.log_and_register_model(run_id, config.mlflow_uri, saved_model_dir, keras_path, "tiny",
                                                   manifest)

    assert version.flavor == "python_function"
    frame = rows.raw_rows(manifest, 4)
    frame.loc[0, "color"] = None  # a missing string
    # (A missing number needs the imputation built from statistics, which this dataset has none of: the wine
    # table's tests in tests/serving cover it.)
    frame["ignored"] = "extra columns are ignored"
    expected = _expected_probabilities(model, manifest, frame)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", config.mlflow_uri)  # models:/ URIs resolve through it
    loaded = mlflow.pyfunc.load_model(f"models:/tiny/{version.version}")
    schema = {s.name: s.to_dict()["type"] for s in loaded.metadata.get_input_schema().inputs}
    assert schema == {"x": "array", "size": "double", "color": "string"}
    outputs = {s.name: s.to_dict()["type"] for s in loaded.metadata.get_output_schema().inputs}
    assert outputs == {"prediction": "long", **{f"probability_{c}": "float" for c in range(3)}}
    got = loaded.predict(frame)
    np.testing.assert_allclose(got.filter(like="probability_").to_numpy(), expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(Exception, match="color"):
        loaded.predict(frame.drop(columns=["color"]))
