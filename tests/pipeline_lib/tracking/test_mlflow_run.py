"""Tracking against a real sqlite MLflow store: runs, params, metric history, artifacts, the registry, no secrets."""

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

from pipeline_lib.config import parse_config
from pipeline_lib.data.manifest import (
    DType,
    FeatureSpec,
    Manifest,
    Schema,
    ShardInfo,
    SourceFingerprint,
)
from pipeline_lib.tracking import mlflow_run as tracking
from pipeline_lib.training import input_pipeline, models
from pipeline_lib.training.loop import TrainResult
from tests.conftest import make_plan, write_dataset

SECRET = "s3cr3t-value-123"
ACCESS_KEY = "AKIAEXAMPLEKEY0042"


@pytest.fixture(autouse=True)
def _no_ambient_store(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


def _config(tmp_path, **tracking_section):
    options = {"secret": SECRET, "key": ACCESS_KEY}
    return parse_config({
        "name": "demo",
        "data": {"source": "s3://bucket/raw/*.csv", "label": "label", "storage_options": options},
        "output_root": str(tmp_path / "root"),
        "storage_options": options,
        "model": {"params": {"hidden_units": [8]}},
        "train": {"per_replica_batch_size": 16, "base_learning_rate": 0.001},
        "tracking": {"experiment": "exp", "registered_model": "tiny", **tracking_section},
    })


def _train_result(tmp_path) -> TrainResult:
    return TrainResult(
        run_dir=str(tmp_path / "run"), strategy="mirrored", strategy_reason="2 logical CPUs", num_workers=1,
        num_replicas=2, per_replica_batch_size=16, global_batch_size=32, base_learning_rate=0.001,
        scaled_learning_rate=0.002, lr_scaling="linear", steps_per_epoch=8, total_steps=40, final_step=40,
        final_loss=0.3, checkpoint_dir=str(tmp_path / "run" / "checkpoints"), checkpoints=(),
        tensorboard_dir=str(tmp_path / "run" / "tensorboard"))


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


def _all_run_text(client: MlflowClient, run_id: str, tmp_path) -> str:
    """Every param, tag, metric name and artifact byte of a run, as one string to search."""
    run = client.get_run(run_id)
    parts = [f"{k}={v}" for k, v in run.data.params.items()] + [f"{k}={v}" for k, v in run.data.tags.items()]
    parts += list(run.data.metrics)
    local = mlflow.artifacts.download_artifacts(run_id=run_id, dst_path=str(tmp_path / "downloaded"),
                                                tracking_uri=client.tracking_uri)
    for root, _dirs, names in os.walk(local):
        for name in names:
            parts.append(Path(root, name).read_bytes().decode("latin-1"))
    return "\n".join(parts)


def test_start_run_creates_the_experiment_once_and_reuses_the_run(tmp_path):
    artifacts = str(tmp_path / "artifact-root")
    config = _config(tmp_path, mlflow_uri=f"sqlite:///{tmp_path}/store/mlflow.db", artifact_location=artifacts)

    run_id = tracking.start_run(config, "demo-run-1", tags={"prefect_flow_run_id": "abc",
                                                           "aws_secret_access_key": SECRET})
    again = tracking.start_run(config, "demo-run-1")
    other = tracking.start_run(config, "demo-run-2")

    client = MlflowClient(config.mlflow_uri)
    experiment = client.get_experiment_by_name("exp")
    assert experiment.artifact_location == artifacts
    assert again == run_id and other != run_id
    run = client.get_run(run_id)
    assert run.info.status == "RUNNING" and run.info.run_name == "demo-run-1"
    assert run.data.tags["prefect_flow_run_id"] == "abc"
    assert run.data.tags["tfdag.config_hash"] == config.config_hash()
    assert "aws_secret_access_key" not in run.data.tags
    tracking.finish_run(run_id, config.mlflow_uri, "FAILED")
    assert client.get_run(run_id).info.status == "FAILED"
    assert tracking.start_run(config, "demo-run-1") != run_id  # a finished run is not reused
    with pytest.raises(tracking.TrackingError, match="'DONE' is not one of"):
        tracking.finish_run(run_id, config.mlflow_uri, "done")


def test_default_store_is_sqlite_under_output_root(tmp_path):
    config = _config(tmp_path)
    run_id = tracking.start_run(config, "r")
    assert config.mlflow_uri == f"sqlite:///{tmp_path}/root/mlflow.db"
    assert os.path.exists(tmp_path / "root" / "mlflow.db")
    experiment = MlflowClient(config.mlflow_uri).get_experiment_by_name("exp")
    assert experiment.artifact_location.endswith(os.path.join("root", "mlartifacts"))
    assert tracking.run_ui_url(config.mlflow_uri, run_id) is None


def test_mlflow_sink_batches_into_the_metric_history(tmp_path):
    config = _config(tmp_path)
    run_id = tracking.start_run(config, "sink")
    sink = tracking.MlflowSink(run_id, config.mlflow_uri, flush_every=5)
    client = MlflowClient(config.mlflow_uri)
    for step in range(1, 4):
        sink.log_metrics({"loss": 1.0 / step, "learning_rate": 0.01}, step=step)
    # 6 values ≥ flush_every: sent; nothing is held back but what came after.
    assert [m.step for m in client.get_metric_history(run_id, "loss")] == [1, 2, 3]
    sink.log_metrics({"loss": 0.2}, step=4)
    assert len(client.get_metric_history(run_id, "loss")) == 3
    sink.flush()
    history = client.get_metric_history(run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(1, 1.0), (2, 0.5), (3, pytest.approx(1 / 3)), (4, 0.2)]
    assert isinstance(tracking.create_sink(None, config.mlflow_uri), tracking.NullSink)


def test_mlflow_sink_keeps_values_when_the_store_fails(tmp_path):
    config = _config(tmp_path)
    run_id = tracking.start_run(config, "sink-failure")
    sink = tracking.MlflowSink(run_id, config.mlflow_uri, flush_every=100)
    sink.log_metrics({"loss": 1.0}, step=1)
    tracking.finish_run(run_id, config.mlflow_uri)
    MlflowClient(config.mlflow_uri).delete_run(run_id)  # a deleted run refuses writes
    sink.flush()  # warns instead of raising into the training loop
    assert len(sink._pending) == 1
    MlflowClient(config.mlflow_uri).restore_run(run_id)
    sink.flush()
    assert [m.value for m in MlflowClient(config.mlflow_uri).get_metric_history(run_id, "loss")] == [1.0]


def test_pipeline_params_and_no_secret_anywhere_in_the_run(tmp_path, tiny_manifest):
    config = _config(tmp_path)
    plan = make_plan(tiny_manifest, replicas_per_worker=2, per_replica_batch_size=16, epochs=5)
    train_result = _train_result(tmp_path)
    tensorboard = tmp_path / "run" / "tensorboard" / "train"
    tensorboard.mkdir(parents=True)
    (tensorboard / "events.out.tfevents.1").write_bytes(b"scalars")
    run_id = tracking.start_run(config, "params")

    params = tracking.pipeline_params(config, train_result, plan, tiny_manifest,
                                      {"tensorflow": tf.__version__, "keras_version": keras.__version__})
    tracking.log_params(run_id, config.mlflow_uri, {**params, "storage_options": dict(config.storage_options),
                                                    "aws_session_token": SECRET})
    tracking.log_final_metrics(run_id, config.mlflow_uri, {"accuracy": 0.75, "auc": float("nan")}, step=40)
    tracking.record_restart(run_id, config.mlflow_uri, 1, "worker 1 exited with code 137")
    tracking.log_artifacts(run_id, config.mlflow_uri, {
        "data/manifest.json": tiny_manifest.to_json(),
        "data/shard_plan.json": plan.model_dump_json(indent=2).encode(),
        "tensorboard": train_result.tensorboard_dir,
        "cluster/never_written": str(tmp_path / "missing-dir"),
    })

    client = MlflowClient(config.mlflow_uri)
    run = client.get_run(run_id)
    logged = run.data.params
    assert logged["strategy"] == "mirrored"
    assert logged["num_replicas"] == "2"
    assert logged["per_replica_batch_size"] == "16" and logged["global_batch_size"] == "32"
    assert logged["base_learning_rate"] == "0.001" and logged["scaled_learning_rate"] == "0.002"
    assert logged["lr_scaling"] == "linear" and logged["epochs"] == "5"
    assert logged["steps_per_epoch"] == "8" and logged["total_steps"] == "40"
    assert logged["tensorflow_version"] == tf.__version__ and logged["keras_version"] == keras.__version__
    assert logged["data_fingerprint"] == tiny_manifest.fingerprint
    assert logged["shard_policy"] == "data" and logged["shard_num_files"] == "1"
    assert "storage_options" not in logged and "aws_session_token" not in logged
    assert run.data.metrics["final_eval_accuracy"] == 0.75 and "final_eval_auc" not in run.data.metrics
    assert run.data.metrics["num_restarts"] == 1.0
    artifact_paths = {a.path for a in client.list_artifacts(run_id)}
    assert artifact_paths == {"data", "tensorboard"}
    assert [a.path for a in client.list_artifacts(run_id, "tensorboard/train")] == [
        "tensorboard/train/events.out.tfevents.1"]

    everything = _all_run_text(client, run_id, tmp_path)
    assert "shard_plan" in everything  # the scan does see the artifacts
    assert SECRET not in everything and ACCESS_KEY not in everything


@pytest.mark.slow
def test_numeric_model_is_logged_with_the_keras_flavor_and_registered(tmp_path, monkeypatch):
    manifest = _write_numeric_dataset(str(tmp_path / "data"))
    config = _config(tmp_path)
    model = _save_model(config, manifest, str(tmp_path / "model.keras"))
    run_id = tracking.start_run(config, "register")
    env_before = os.environ.get("MLFLOW_TRACKING_URI")

    version = tracking.log_and_register_model(run_id, config.mlflow_uri, str(tmp_path / "model.keras"), "tiny",
                                              manifest, tags={"tfdag_run_name": "register", "api_token": SECRET})
    second = tracking.log_and_register_model(run_id, config.mlflow_uri, str(tmp_path / "model.keras"), "tiny",
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
    config = _config(tmp_path)
    model = _save_model(config, manifest, str(tmp_path / "model.keras"))
    run_id = tracking.start_run(config, "strings")

    version = tracking.log_and_register_model(run_id, config.mlflow_uri, str(tmp_path / "model.keras"), "tiny",
                                              manifest)

    assert version.flavor == "python_function"
    inputs, expected = _predictions(model, manifest)
    assert inputs["color"].dtype == object
    monkeypatch.setenv("MLFLOW_TRACKING_URI", config.mlflow_uri)  # models:/ URIs resolve through it
    loaded = mlflow.pyfunc.load_model(f"models:/tiny/{version.version}")
    assert sorted(s.name for s in loaded.metadata.get_input_schema().inputs) == ["color", "numeric"]
    np.testing.assert_allclose(np.asarray(loaded.predict(inputs)), expected, rtol=1e-5, atol=1e-6)
