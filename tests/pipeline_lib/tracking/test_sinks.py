"""The MLflow metrics sink against a real sqlite store, and the one sink factory."""

from __future__ import annotations

import pytest
from mlflow import MlflowClient

from pipeline_lib.tracking import run as tracking
from pipeline_lib.tracking import sinks
from pipeline_lib.training.hooks import NullSink
from tests.pipeline_lib.tracking.conftest import tracking_config


def test_mlflow_sink_batches_into_the_metric_history(tmp_path):
    config = tracking_config(tmp_path)
    run_id = tracking.start_run(config, "sink")
    sink = sinks.MlflowSink(run_id, config.mlflow_uri, flush_every=5)
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


def test_mlflow_sink_logs_checkpoint_evaluations_apart_from_the_exported_models_metrics(tmp_path):
    config = tracking_config(tmp_path)
    run_id = tracking.start_run(config, "sink-names")
    sink = sinks.MlflowSink(run_id, config.mlflow_uri, flush_every=100)
    sink.log_metrics({"loss": 0.5, "eval_accuracy": 0.9, "eval_loss": 0.3}, step=10)
    sink.log_metrics({"loss": 0.4, "eval_accuracy": 0.7, "eval_loss": 0.6}, step=20)  # a worse last checkpoint
    sink.flush()
    tracking.log_final_metrics(run_id, config.mlflow_uri, {"accuracy": 0.9, "loss": 0.3}, step=20)
    metrics = MlflowClient(config.mlflow_uri).get_run(run_id).data.metrics
    # No bare `eval_accuracy` of the last checkpoint (0.7) beside the exported model's 0.9.
    assert metrics == {"loss": 0.4, "checkpoint/eval_accuracy": 0.7, "checkpoint/eval_loss": 0.6,
                       "final_eval_accuracy": 0.9, "final_eval_loss": 0.3}


def test_create_sink_gives_mlflow_only_to_the_chief_of_a_tracked_run(tmp_path):
    config = tracking_config(tmp_path)
    run_id = tracking.start_run(config, "factory")
    assert isinstance(sinks.create_sink(None, config.mlflow_uri), NullSink)
    assert isinstance(sinks.create_sink(run_id, config.mlflow_uri, is_chief=False), NullSink)
    sink = sinks.create_sink(run_id, config.mlflow_uri, flush_every=7)
    assert isinstance(sink, sinks.MlflowSink) and sink.run_id == run_id and sink.flush_every == 7


def test_mlflow_sink_keeps_values_when_the_store_fails(tmp_path):
    config = tracking_config(tmp_path)
    run_id = tracking.start_run(config, "sink-failure")
    sink = sinks.MlflowSink(run_id, config.mlflow_uri, flush_every=100)
    sink.log_metrics({"loss": 1.0}, step=1)
    tracking.finish_run(run_id, config.mlflow_uri)
    MlflowClient(config.mlflow_uri).delete_run(run_id)  # a deleted run refuses writes
    sink.flush()  # warns instead of raising into the training loop
    assert len(sink._pending) == 1
    MlflowClient(config.mlflow_uri).restore_run(run_id)
    sink.flush()
    assert [m.value for m in MlflowClient(config.mlflow_uri).get_metric_history(run_id, "loss")] == [1.0]
