"""The training-pipeline flow end to end on the digits data: MLflow contents and the exported model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from pipeline_lib.config import parse_config
from pipeline_lib.data import demo as demo_data
from pipeline_lib.training.errors import TrainingError
from pipeline_lib.training.results import TrainResult

ROOT = Path(__file__).resolve().parents[2]


def digits_config(tmp_path: Path, **train) -> dict:
    raw = tmp_path / "raw" / "digits.csv"
    demo_data.write_digits_csv(str(raw))
    return {
        "name": "digits-flow-test",
        "data": {"source": str(raw), "label": "target", "target_shard_mb": 0.1},
        "output_root": str(tmp_path / "out"),
        "model": {"factory": "mlp", "params": {"hidden_units": [64]}},
        "train": {"strategy": "mirrored", "cpu_replicas": 2, "per_replica_batch_size": 32,
                  "base_learning_rate": 0.002, "epochs": 6, "checkpoint_every_steps": 40,
                  "log_every_steps": 20, "seed": 7, **train},
        "evaluation": {"metrics": ["loss", "accuracy", "auc", "confusion_matrix"]},
        "tracking": {"experiment": "flow-test", "registered_model": "digits-flow-test"},
    }


@pytest.mark.slow
def test_training_pipeline_end_to_end(digits_run, tmp_path):
    """The session's shared run (tests/flows/conftest.py): 2 mirrored replicas, deterministic, shuffled, Adam."""
    import mlflow
    from mlflow.tracking import MlflowClient

    config, summary = digits_run.config, digits_run.summary

    assert summary.metrics["accuracy"] >= 0.9
    assert summary.blessed and summary.gate.blessed and summary.champion_metrics == {}
    assert summary.num_replicas == 2 and summary.global_batch_size == 64
    client = MlflowClient(tracking_uri=config.mlflow_uri)
    run = client.get_run(summary.mlflow_run_id)
    # The run ends with the pipeline, not left RUNNING.
    assert run.info.status == "FINISHED" and run.info.end_time >= run.info.start_time
    assert "tfdag.failed_stage" not in run.data.tags
    params = run.data.params
    assert params["strategy"] == "mirrored"
    assert int(params["num_replicas"]) == 2
    assert int(params["per_replica_batch_size"]) == 32
    assert int(params["global_batch_size"]) == 64
    assert float(params["base_learning_rate"]) == pytest.approx(0.002)
    assert float(params["scaled_learning_rate"]) == pytest.approx(0.004)  # linear rule × 2 replicas
    assert params["lr_scaling"] == "linear"
    assert params["data_fingerprint"] == summary.data_fingerprint
    assert int(params["steps_per_epoch"]) * config.train.epochs == int(params["total_steps"]) == summary.final_step
    assert params["deterministic"] == "True" and params["optimizer"] == "adam"
    # Early stopping (on by default) watched the gate metric and ran out of evaluations before patience (5).
    assert not summary.stopped_early and summary.stopped_at_step is None
    assert summary.stop_reason.startswith(f"trained the planned {summary.final_step} steps")
    assert (params["stopped_early"], params["stop_reason"]) == ("False", summary.stop_reason)
    assert params["early_stopping_metric"] == "eval_accuracy" and params["best_step"] == str(summary.best_step)
    assert params["tensorflow_version"].startswith("2.21")

    history = client.get_metric_history(run.info.run_id, "loss")
    assert len(history) >= 3
    assert history[-1].value < history[0].value
    assert run.data.metrics["final_eval_accuracy"] == pytest.approx(summary.metrics["accuracy"])
    # The trivial model (the train split's majority class) scored beside it, and beaten: the gate says by how much.
    assert summary.baseline_model.startswith("majority class") and summary.baseline_metrics["accuracy"] < 0.2
    assert run.data.metrics["baseline.accuracy"] == pytest.approx(summary.baseline_metrics["accuracy"])
    assert summary.gate.baseline_value == pytest.approx(summary.baseline_metrics["accuracy"])
    assert "; beats the trivial model (majority class " in summary.gate.reason
    # The per-checkpoint evaluations are a curve under `checkpoint/`, one value per checkpoint.
    assert "eval_accuracy" not in run.data.metrics
    assert len(client.get_metric_history(run.info.run_id, "checkpoint/eval_accuracy")) >= 2
    assert run.data.tags["prefect_flow_run_id"]

    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"data", "cluster", "evaluation", "logs", "config"} <= artifacts
    version = client.get_model_version("digits-flow-test", summary.model_version)
    assert version.run_id == run.info.run_id
    # A passing gate registers as before, tagged blessed; the training pipeline itself moves no alias.
    assert run.data.tags["tfdag.blessed"] == "true" and version.tags["blessed"] == "true"
    assert not version.aliases
    # The model check before registration passed on both loaders, in a fresh process without tfdag.
    assert summary.model_validated is True and run.data.tags["tfdag.model_validated"] == "true"
    checked = json.loads(Path(client.download_artifacts(run.info.run_id, "evaluation/model_validation.json",
                                                        str(tmp_path / "v"))).read_text())
    assert [c["loader"] for c in checked["checks"]] == ["tf.saved_model.load", "mlflow.pyfunc.load_model"]
    assert all(c["passed"] and c["max_abs_diff"] <= 1e-5 for c in checked["checks"]) and checked["rows"] == 64

    # The exported model reloads and gives the registered model's predictions.
    import keras

    export_dir = Path(summary.export_dir)
    reloaded = keras.saving.load_model(export_dir / "model.keras")
    import tensorflow as tf

    from pipeline_lib.data.manifest import load_manifest
    from pipeline_lib.serving.rows import raw_rows
    from pipeline_lib.tracking.client import global_tracking_uri

    manifest = load_manifest(str(Path(config.output_root) / "data" / summary.data_fingerprint))
    frame = raw_rows(manifest, 16)  # the table's own rows: pixel_0..pixel_63
    packed = {"numeric": frame[list(manifest.feature_schema.feature_names)].to_numpy(np.float32)}
    expected = tf.nn.softmax(np.asarray(reloaded.predict(packed, verbose=0))).numpy()
    with global_tracking_uri(config.mlflow_uri):  # scoped: a process-wide URI would redirect later tests
        served = mlflow.pyfunc.load_model(f"models:/digits-flow-test/{summary.model_version}")
    # The registered model takes the table's own rows and answers in the label's values.
    got = served.predict(frame)
    np.testing.assert_allclose(got.filter(like="probability_").to_numpy(), expected, atol=1e-5)
    np.testing.assert_array_equal(got["prediction"].to_numpy(), expected.argmax(axis=1))


    # What MLflow 3's run page shows: source, datasets, system metrics, the model with its metrics and input
    # example, the experiment in the model-training view, the resolved config.
    assert run.data.tags["mlflow.source.name"] == "prefect flow training-pipeline"
    assert run.data.tags["mlflow.source.type"] == "JOB"
    experiment = client.get_experiment(run.info.experiment_id)
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    datasets = {d.dataset.name: d for d in run.inputs.dataset_inputs}
    assert set(datasets) == {"digits-flow-test-train", "digits-flow-test-eval"}
    train_input = datasets["digits-flow-test-train"]
    assert train_input.dataset.digest == summary.data_fingerprint[:36]
    assert json.loads(train_input.dataset.profile)["num_rows"] == manifest.num_records("train")
    assert json.loads(train_input.dataset.source)["uri"].endswith(summary.data_fingerprint)
    assert {t.key: t.value for t in train_input.tags}["mlflow.data.context"] == "training"
    assert "target" in train_input.dataset.schema
    assert any(name.startswith("system/cpu_utilization_percentage") for name in run.data.metrics)
    assert any(name.startswith("system/system_memory_usage") for name in run.data.metrics)
    [logged] = client.search_logged_models([run.info.experiment_id],
                                          filter_string=f"source_run_id = '{run.info.run_id}'")
    model_metrics = {m.key: m.value for m in logged.metrics}
    assert model_metrics["final_eval_accuracy"] == pytest.approx(summary.metrics["accuracy"])
    assert version.model_id == logged.model_id or version.source == f"models:/{logged.model_id}", version
    model_files = {a.path for a in client.list_artifacts(run.info.run_id)} | set(
        os.listdir(mlflow.artifacts.download_artifacts(logged.artifact_location, dst_path=str(tmp_path / "m"))))
    assert "input_example.json" in model_files and "serving_input_example.json" in model_files
    config_text = Path(client.download_artifacts(run.info.run_id, "config/pipeline.yaml", str(tmp_path / "c"))
                       ).read_text()
    assert yaml.safe_load(config_text)["name"] == "digits-flow-test"
    plot_names = {a.path for a in client.list_artifacts(run.info.run_id, "evaluation/plots")}
    assert "evaluation/plots/confusion_matrix.png" in plot_names

    # The train task's progress artifact in Prefect ends at 100 % with the final step.
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    # (Read among this flow run's artifacts: other tests' runs use the same key on the session's Prefect server.)
    with get_client(sync_client=True) as prefect:
        flow_run_artifacts = prefect.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[run.data.tags["prefect_flow_run_id"]])))
    [model_check] = [a for a in flow_run_artifacts if a.key == "digits-flow-test-model-validation"]
    assert model_check.data.startswith("# Model check: passed")
    [progress] = [a for a in flow_run_artifacts if a.key == "digits-flow-test-training-progress"]
    assert progress.type == "progress" and float(progress.data) == 100.0
    assert f"done at step {summary.final_step} of {summary.final_step}" in progress.description

    # The convert task's progress artifact, among this flow run's artifacts, ends at 100 % with every row.
    [conversion] = [a for a in flow_run_artifacts if a.key == "digits-flow-test-conversion-progress"]
    assert conversion.type == "progress" and float(conversion.data) == 100.0
    rows = manifest.num_records("train") + manifest.num_records("eval")
    assert conversion.description.startswith(f"conversion: done, {rows:,} rows | ") and "MB/s" in conversion.description


@pytest.mark.slow
def test_a_model_the_gate_refuses_is_not_registered_and_tfdag_run_exits_3(tmp_path, prefect_api):
    """An unreachable threshold: the model is logged to a FINISHED run, not registered; every surface says so."""
    import yaml
    from mlflow.tracking import MlflowClient
    from prefect.client.orchestration import get_client

    # Training in the CLI's own process and no model check (the check is the shared run's and the broken-export
    # test's): what is asserted here is the gate's refusal on every surface, not the worker or the check.
    data = digits_config(tmp_path, strategy="default", cpu_replicas=None, epochs=1, isolation="none")
    data["name"] = "digits-not-blessed"
    data["tracking"]["registered_model"] = "digits-not-blessed"
    data["evaluation"]["gate"] = {"metric": "accuracy", "threshold": 0.9999}
    data["evaluation"]["validate_model"] = False
    path = tmp_path / "digits.yaml"
    path.write_text(yaml.safe_dump(data))
    out = subprocess.run([sys.executable, "-m", "flows.cli", "run", str(path), "--json"], cwd=ROOT, check=False,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 3, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    summary = json.loads(lines[-1])
    assert summary["blessed"] is False and summary["model_version"] is None
    gate = summary["gate"]
    assert gate["metric"] == "accuracy" and gate["threshold"] == 0.9999 and gate["champion_value"] is None
    assert gate["value"] == pytest.approx(summary["metrics"]["accuracy"])
    assert "misses evaluation.gate.threshold (≥ 0.9999)" in gate["reason"]
    assert lines[-2].startswith("tfdag | blessed: false | accuracy ") and "≥ 0.9999" in lines[-2]
    assert lines[-3] == "tfdag | not registered (tracking.register: blessed)"

    config = parse_config(data)
    client = MlflowClient(tracking_uri=config.mlflow_uri, registry_uri=config.mlflow_uri)
    assert client.search_model_versions("name = 'digits-not-blessed'") == []
    run = client.get_run(summary["mlflow_run_id"])
    assert run.info.status == "FINISHED" and "tfdag.failed_stage" not in run.data.tags
    assert run.data.tags["tfdag.blessed"] == "false"
    logged = client.search_logged_models(experiment_ids=[run.info.experiment_id])
    assert [m.source_run_id for m in logged] == [run.info.run_id]  # logged to the run, not registered
    with get_client(sync_client=True) as prefect:
        flow_run = prefect.read_flow_run(run.data.tags["prefect_flow_run_id"])
    assert flow_run.state.is_completed() and flow_run.state.name == "Not blessed"
    assert "misses evaluation.gate.threshold" in flow_run.state.message


@pytest.mark.slow
def test_register_always_registers_a_refused_model_tagged_blessed_false_without_an_alias(tmp_path, prefect_api):
    from mlflow.tracking import MlflowClient

    from flows.pipeline import training_pipeline

    # In process, no model check: the register policy is what is tested (the gate-refuses test above proves the
    # same refusal under `register: blessed`).
    data = digits_config(tmp_path, strategy="default", cpu_replicas=None, epochs=1, isolation="none")
    data["name"] = data["tracking"]["registered_model"] = "digits-register-always"
    data["tracking"]["register"] = "always"
    data["evaluation"]["gate"] = {"metric": "accuracy", "threshold": 0.9999}
    data["evaluation"]["validate_model"] = False
    config = parse_config(data)
    summary = training_pipeline(config)  # the in-process call still returns the summary

    assert not summary.blessed and summary.model_version == "1"
    client = MlflowClient(tracking_uri=config.mlflow_uri, registry_uri=config.mlflow_uri)
    version = client.get_model_version("digits-register-always", "1")
    assert version.tags["blessed"] == "false" and "threshold" in version.tags["tfdag.decision_reason"]
    assert not version.aliases and not client.get_registered_model("digits-register-always").aliases
    assert client.get_run(summary.mlflow_run_id).info.status == "FINISHED"


@pytest.mark.slow
def test_a_model_whose_export_does_not_load_is_not_blessed_nor_registered_even_with_register_always(
        tmp_path, prefect_api):
    """The SavedModel broken after the model was logged (pipeline_lib.testing.export_faults.breaking_exports):
    metrics that bless, a check that fails. One 1-epoch flow run, in process: the CLI's exit 3 follows
    `summary.blessed` (cmd_run), as the unreachable-threshold test above shows through `tfdag run`."""
    from mlflow.tracking import MlflowClient
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from flows import console
    from flows.pipeline import NOT_BLESSED_STATE, final_state, training_pipeline
    from pipeline_lib.testing.export_faults import breaking_exports

    # Trained in the flow's own process (isolation none): the model check, not the worker, is under test.
    data = digits_config(tmp_path, strategy="default", cpu_replicas=None, epochs=1, isolation="none")
    data["name"] = data["tracking"]["registered_model"] = "digits-broken-export"
    data["tracking"]["register"] = "always"
    config = parse_config(data)
    with breaking_exports("corrupt_variables"):
        summary = training_pipeline(config)

    assert not summary.blessed and summary.model_version is None and summary.model_validated is False
    reason = summary.gate.reason
    assert reason.startswith("the model check failed: tf.saved_model.load(") and "without tfdag: " in reason
    assert "fix: the SavedModel must load with TensorFlow alone" in reason
    assert "; the evaluation gate: accuracy " in reason and "no champion yet" in reason  # the metrics alone bless
    assert final_state(summary).name == NOT_BLESSED_STATE
    assert "tfdag | not registered (the model check failed)" in console.summary_event(summary).lines

    client = MlflowClient(tracking_uri=config.mlflow_uri, registry_uri=config.mlflow_uri)
    assert client.search_model_versions("name = 'digits-broken-export'") == []
    run = client.get_run(summary.mlflow_run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["tfdag.model_validated"] == "false" and run.data.tags["tfdag.blessed"] == "false"
    assert run.data.tags["tfdag.model_validation"].startswith("the model check failed: tf.saved_model.load(")
    detail = json.loads(Path(client.download_artifacts(run.info.run_id, "evaluation/model_validation.json",
                                                       str(tmp_path / "v"))).read_text())
    checks = {c["loader"]: c for c in detail["checks"]}
    # The logged model is a copy taken before the fault: its loader passes; the broken SavedModel's does not.
    assert not checks["tf.saved_model.load"]["passed"] and checks["tf.saved_model.load"]["traceback"]
    assert checks["mlflow.pyfunc.load_model"]["passed"]
    with get_client(sync_client=True) as prefect:
        [artifact] = prefect.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=["digits-broken-export-model-validation"])))
    assert artifact.data.startswith("# Model check: FAILED") and "`tf.saved_model.load`" in artifact.data


def test_cli_rejects_bad_config_before_anything_runs(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("data: {source: x.csv, label: y}\ntrain: {per_replica_batch_size: 0}\n")
    out = subprocess.run([sys.executable, "-m", "flows.cli", "run", str(path)], cwd=ROOT, check=False,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2
    assert "train.per_replica_batch_size (0) in bad.yaml" in out.stderr
    assert not (tmp_path / ".tfdag").exists()


@pytest.mark.slow
def test_a_failed_stage_leaves_a_markdown_artifact_naming_it(tmp_path, prefect_api):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from flows.pipeline import training_pipeline
    from pipeline_lib.planning.sharding import PlanError

    data = digits_config(tmp_path, strategy="default", cpu_replicas=None, per_replica_batch_size=100_000)
    data["name"] = "digits-failing-plan"
    with pytest.raises(PlanError, match="global batch"):
        training_pipeline(parse_config(data))

    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["digits-failing-plan-failure"])))
    assert artifacts, "no failure artifact"
    markdown = artifacts[0].data
    assert "**Stage:** `plan_shards`" in markdown and "global batch" in markdown
    # The MLflow run started before conversion; the planning failure ends it FAILED, naming the stage.
    [run] = _pipeline_runs(parse_config(data), "digits-failing-plan")
    assert run.info.status == "FAILED" and run.info.end_time is not None
    assert run.data.tags["tfdag.failed_stage"] == "plan_shards"


def _pipeline_runs(config, pipeline: str) -> list:
    """The MLflow runs of one pipeline name in the config's store and experiment."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=config.mlflow_uri)
    experiment = client.get_experiment_by_name(config.tracking.experiment)
    return client.search_runs([experiment.experiment_id], filter_string=f"tags.`tfdag.pipeline` = '{pipeline}'")


@pytest.mark.slow
@pytest.mark.parametrize(("error", "status"), [
    (TrainingError("worker 0 exited with code 1"), "FAILED"),
    (KeyboardInterrupt(), "KILLED"),
], ids=["failure", "ctrl-c"])
def test_a_failure_or_interrupt_in_training_ends_the_mlflow_run_naming_the_stage(tmp_path, prefect_api, monkeypatch,
                                                                                 error, status):
    from flows.pipeline import training_pipeline
    from pipeline_lib.launch import local as launcher

    def launch_training(*args, **kwargs):
        raise error

    monkeypatch.setattr(launcher, "launch_training", launch_training)
    data = digits_config(tmp_path, strategy="default", cpu_replicas=None)
    data["name"] = f"digits-{status.lower()}-in-train"
    with pytest.raises(type(error)):
        training_pipeline(parse_config(data))

    [run] = _pipeline_runs(parse_config(data), data["name"])
    assert run.info.status == status and run.info.end_time is not None
    assert run.data.tags["tfdag.failed_stage"] == "train"


@pytest.mark.slow
def test_a_worker_that_fails_leaves_its_traceback_in_the_failed_runs_logs(tmp_path, prefect_api, monkeypatch):
    from mlflow.tracking import MlflowClient

    from flows.pipeline import training_pipeline
    from pipeline_lib.launch.errors import WorkerFailed

    monkeypatch.setenv("TFDAG_FAULT", "raise:worker=0:step=5")
    data = digits_config(tmp_path, strategy="default", cpu_replicas=None, epochs=1)
    data["name"] = "digits-worker-traceback"
    config = parse_config(data)
    with pytest.raises(WorkerFailed):
        training_pipeline(config)

    [run] = _pipeline_runs(config, data["name"])
    assert run.info.status == "FAILED" and run.data.tags["tfdag.failed_stage"] == "train"
    client = MlflowClient(tracking_uri=config.mlflow_uri)
    assert {a.path for a in client.list_artifacts(run.info.run_id, "logs")} == {"logs/worker-0.log"}
    kept = Path(client.download_artifacts(run.info.run_id, "logs/worker-0.log", str(tmp_path / "dl"))).read_text()
    assert "Traceback (most recent call last)" in kept and "FaultInjected" in kept


@pytest.mark.slow
def test_a_failure_after_training_ends_the_mlflow_run_failed_naming_the_stage(tmp_path, prefect_api, monkeypatch):
    from flows.pipeline import training_pipeline
    from pipeline_lib.evaluation.consolidation import ConsolidationError
    from pipeline_lib.launch import local as launcher

    def launch_training(config, manifest, plan, run_dir, **kwargs):
        """Training that 'finished' without a checkpoint: consolidation, the next stage, fails."""
        return TrainResult(
            run_dir=run_dir, strategy="default", strategy_reason="test", num_workers=1, num_replicas=1,
            per_replica_batch_size=32, global_batch_size=32, base_learning_rate=0.002, scaled_learning_rate=0.002,
            lr_scaling="none", steps_per_epoch=1, total_steps=1, final_step=1, final_loss=1.0,
            checkpoint_dir=f"{run_dir}/checkpoints", checkpoints=(), tensorboard_dir=f"{run_dir}/tensorboard")

    monkeypatch.setattr(launcher, "launch_training", launch_training)
    data = digits_config(tmp_path, strategy="default", cpu_replicas=None)
    data["name"] = "digits-failed-after-train"
    with pytest.raises(ConsolidationError, match="lists no checkpoints"):
        training_pipeline(parse_config(data))

    [run] = _pipeline_runs(parse_config(data), data["name"])
    assert run.info.status == "FAILED" and run.info.end_time is not None
    assert run.data.tags["tfdag.failed_stage"] == "consolidate_checkpoints"


@pytest.mark.slow
def test_an_elastic_shrink_a_restart_and_a_fault_after_the_final_checkpoint_show_in_mlflow_the_log_and_summary(
        tmp_path, prefect_api, monkeypatch):
    """One elastic flow of 2 workers, two real SIGKILLs through the documented test-only settings the workers
    inherit: worker 1 at step 30 with only 1 local "node" up (pipeline_lib.testing.local_nodes, in the launcher the
    flow runs in this process), so the group resumes from the step-20 checkpoint on 1 worker (a resize and a restart);
    then worker 0 after the final checkpoint is saved and before the result is written (the restarted process
    restores the final step, trains nothing, and the pipeline goes on to consolidation and evaluation). Each fault
    has its own marker, so each fires once."""
    import time

    from mlflow.tracking import MlflowClient
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    from flows.pipeline import training_pipeline
    from pipeline_lib.testing.faults import FAULT_ENV
    from pipeline_lib.testing.local_nodes import local_nodes

    nodes = tmp_path / "nodes"
    nodes.write_text("1")
    monkeypatch.setenv(FAULT_ENV, "kill:worker=1:step=30,kill:worker=0:phase=result")
    data = digits_config(tmp_path, strategy="auto", cpu_replicas=None, workers=2, per_replica_batch_size=16, epochs=1,
                         checkpoint_every_steps=20,
                         restart_backoff_s=0.1, elastic={"min_workers": 1, "wait_s": 0.5})
    data["name"] = "digits-restart"
    data["evaluation"]["validate_model"] = False  # the model check is the shared run's; restarts are tested here
    config = parse_config(data)
    with local_nodes(nodes):
        summary = training_pipeline(config)

    assert summary.num_restarts == 2
    shrink = ("worker 1 killed by SIGKILL; 1 of 2 workers could be placed within train.elastic.wait_s (0.5 s)")
    # What `tfdag run --json` prints: the summary as JSON.
    assert json.loads(summary.model_dump_json())["resizes"] == [{"from": 2, "to": 1, "step": 20, "reason": shrink}]
    client = MlflowClient(tracking_uri=config.mlflow_uri)
    run = client.get_run(summary.mlflow_run_id)
    total_steps = int(run.data.params["total_steps"])
    assert total_steps > 30 and summary.final_step == total_steps  # exactly the planned steps after resuming
    assert [m.value for m in client.get_metric_history(run.info.run_id, "num_restarts")][-1] == 2.0
    assert run.data.tags["tfdag.resize.1"] == f"2 → 1 workers at step 20: {shrink}"
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "workers")] == [(0, 2.0), (20, 1.0)]
    assert run.data.tags["tfdag.restart.1"] == f"worker 1 killed by SIGKILL; resumed at step 20 of {total_steps}"
    assert run.data.tags["tfdag.restart.2"] == (
        f"worker 0 killed by SIGKILL; resumed at step {total_steps} of {total_steps}, the final step: nothing left "
        "to train, the result comes from its checkpoint")
    assert "SIGKILL" in run.data.tags["tfdag.last_restart_cause"]
    # The restarts kept the one MLflow run, which ends FINISHED with the pipeline; consolidation and evaluation
    # ran on the checkpoints the attempts wrote, the final one included.
    assert run.info.status == "FINISHED" and run.info.end_time is not None
    assert run.data.metrics["final_eval_accuracy"] == pytest.approx(summary.metrics["accuracy"])
    assert len(_pipeline_runs(config, "digits-restart")) == 1

    flow_run_id = run.data.tags["prefect_flow_run_id"]
    messages: list[str] = []
    for _ in range(20):
        with get_client(sync_client=True) as prefect:
            logs = prefect.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
        messages = [log.message for log in logs]
        if any(m.startswith("restart 2 of") for m in messages):
            break
        time.sleep(0.5)
    for number in (1, 2):
        assert any(m.startswith(f"restart {number} of") and "SIGKILL" in m for m in messages), messages[-20:]
    assert f"resize 1: 2 → 1 workers at step 20: {shrink}" in messages, messages[-20:]
