"""The MLflow run against a real sqlite store: start and end, params, final metrics, artifacts, no secrets."""

from __future__ import annotations

import os
from pathlib import Path

import keras
import mlflow
import pytest
import tensorflow as tf
from mlflow import MlflowClient

from pipeline_lib.tracking import run as tracking
from pipeline_lib.tracking.params import pipeline_params
from pipeline_lib.training.results import TrainResult
from tests.conftest import make_plan
from tests.pipeline_lib.tracking.conftest import ACCESS_KEY, SECRET, tracking_config


def _train_result(tmp_path) -> TrainResult:
    return TrainResult(
        run_dir=str(tmp_path / "run"), strategy="mirrored", strategy_reason="2 logical CPUs", num_workers=1,
        num_replicas=2, per_replica_batch_size=16, global_batch_size=32, base_learning_rate=0.001,
        scaled_learning_rate=0.002, lr_scaling="linear", steps_per_epoch=8, total_steps=40, final_step=24,
        final_loss=0.3, checkpoint_dir=str(tmp_path / "run" / "checkpoints"), checkpoints=(),
        tensorboard_dir=str(tmp_path / "run" / "tensorboard"), early_stopping_metric="eval_accuracy",
        stopped_early=True, stopped_at_step=24, best_step=8, stop_reason=STOP_REASON)


STOP_REASON = ("eval_accuracy did not improve by more than 0 in 2 evaluation(s) (train.early_stopping.patience); "
               "best 0.75 at step 8")


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
    config = tracking_config(tmp_path, mlflow_uri=f"sqlite:///{tmp_path}/store/mlflow.db", artifact_location=artifacts)

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
    assert client.get_run(run_id).info.end_time is not None
    assert tracking.start_run(config, "demo-run-1") != run_id  # a finished run is not reused
    with pytest.raises(tracking.TrackingError, match="'DONE' is not one of"):
        tracking.finish_run(run_id, config.mlflow_uri, "done")


def test_finish_run_ends_with_an_end_time_and_names_the_failed_stage(tmp_path):
    config = tracking_config(tmp_path)
    client = MlflowClient(config.mlflow_uri)
    finished = tracking.start_run(config, "finished")
    failed = tracking.start_run(config, "failed")
    killed = tracking.start_run(config, "killed")

    tracking.finish_run(finished, config.mlflow_uri, tracking.RunStatus.FINISHED)
    tracking.finish_run(failed, config.mlflow_uri, tracking.RunStatus.FAILED, failed_stage="evaluate")
    tracking.finish_run(killed, config.mlflow_uri, "killed", failed_stage="train")

    runs = {run_id: client.get_run(run_id) for run_id in (finished, failed, killed)}
    assert [runs[r].info.status for r in (finished, failed, killed)] == ["FINISHED", "FAILED", "KILLED"]
    assert all(run.info.end_time is not None and run.info.end_time >= run.info.start_time for run in runs.values())
    assert tracking.FAILED_STAGE_TAG not in runs[finished].data.tags
    assert runs[failed].data.tags[tracking.FAILED_STAGE_TAG] == "evaluate"
    assert runs[killed].data.tags[tracking.FAILED_STAGE_TAG] == "train"


def test_default_store_is_sqlite_under_output_root(tmp_path):
    config = tracking_config(tmp_path)
    run_id = tracking.start_run(config, "r")
    assert config.mlflow_uri == f"sqlite:///{tmp_path}/root/mlflow.db"
    assert os.path.exists(tmp_path / "root" / "mlflow.db")
    experiment = MlflowClient(config.mlflow_uri).get_experiment_by_name("exp")
    assert experiment.artifact_location.endswith(os.path.join("root", "mlartifacts"))
    assert tracking.run_ui_url(config.mlflow_uri, run_id) is None


def test_pipeline_params_and_no_secret_anywhere_in_the_run(tmp_path, tiny_manifest):
    config = tracking_config(tmp_path)
    plan = make_plan(tiny_manifest, replicas_per_worker=2, per_replica_batch_size=16, epochs=5)
    train_result = _train_result(tmp_path)
    tensorboard = tmp_path / "run" / "tensorboard" / "train"
    tensorboard.mkdir(parents=True)
    (tensorboard / "events.out.tfevents.1").write_bytes(b"scalars")
    run_id = tracking.start_run(config, "params")

    params = pipeline_params(config, train_result, plan, tiny_manifest,
                                      {"tensorflow": tf.__version__, "keras_version": keras.__version__})
    tracking.log_params(run_id, config.mlflow_uri, {**params, "storage_options": dict(config.storage_options),
                                                    "aws_session_token": SECRET})
    tracking.log_final_metrics(run_id, config.mlflow_uri, {"accuracy": 0.75, "auc": float("nan")}, step=40)
    tracking.record_restart(run_id, config.mlflow_uri, 1, "worker 1 exited with code 137")
    tracking.record_workers(run_id, config.mlflow_uri, 3, 0)  # an elastic run: 3 → 2 at step 12, 2 → 3 at 20
    tracking.record_resize(run_id, config.mlflow_uri, 1, "3 → 2 workers at step 12: worker 2 lost", 2, 12)
    tracking.record_resize(run_id, config.mlflow_uri, 2, "2 → 3 workers at step 20: 3 of 3 workers can be placed "
                           "again", 3, 20)
    tracking.log_artifacts(run_id, config.mlflow_uri, {
        "data/manifest.json": tiny_manifest.to_json(),
        "data/shard_plan.json": plan.model_dump_json(indent=2).encode(),
        "tensorboard": train_result.tensorboard_dir,
        "cluster/never_written": str(tmp_path / "missing-dir"),
    })

    client = MlflowClient(config.mlflow_uri)
    run = client.get_run(run_id)
    logged = run.data.params
    assert run.data.tags["tfdag.resize.1"] == "3 → 2 workers at step 12: worker 2 lost"
    assert run.data.tags["tfdag.resize.2"].startswith("2 → 3 workers at step 20: ")
    workers = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "workers"))
    assert workers == [(0, 3.0), (12, 2.0), (20, 3.0)]
    assert logged["strategy"] == "mirrored"
    assert logged["num_replicas"] == "2"
    assert logged["per_replica_batch_size"] == "16" and logged["global_batch_size"] == "32"
    assert logged["base_learning_rate"] == "0.001" and logged["scaled_learning_rate"] == "0.002"
    assert logged["lr_scaling"] == "linear" and logged["epochs"] == "5"
    assert logged["steps_per_epoch"] == "8" and logged["total_steps"] == "40"
    # How training ended: the early stop, its step, its best step and why; the early-stopping settings.
    assert (logged["stopped_early"], logged["stopped_at_step"], logged["best_step"]) == ("True", "24", "8")
    assert logged["stop_reason"] == STOP_REASON and logged["early_stopping_metric"] == "eval_accuracy"
    assert (logged["early_stopping"], logged["early_stopping_patience"], logged["early_stopping_min_delta"]) == (
        "True", "5", "0.0")
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


