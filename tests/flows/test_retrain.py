"""`prefect deployment run 'retrain/nightly' --watch` on real Prefect and MLflow servers: promote, skip, refuse."""

from __future__ import annotations

import re
import uuid

import pytest

from pipeline_lib.tracking import registry
from tests.flows.conftest import FIRST_APPEND, INITIAL_ROWS, MODEL_NAME, worker_log_tail

pytestmark = pytest.mark.slow


def _flow_run_id(output: str) -> uuid.UUID:
    match = re.search(r"UUID:\s*([0-9a-f-]{36})", output)
    assert match, f"no flow run id in the CLI output:\n{output}"
    return uuid.UUID(match.group(1))


def _read_flow_run(flow_run_id: uuid.UUID):
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(flow_run_id)


def _artifacts(key: str):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        return client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))


def _assert_ok(result, scenario) -> None:
    assert result.returncode == 0, (f"exit {result.returncode}\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}\n"
                                    f"--- worker log ---\n{worker_log_tail(scenario.running)}")


def _versions(client) -> dict[int, object]:
    return {int(v.version): client.get_model_version(MODEL_NAME, v.version)
            for v in client.search_model_versions(f"name = '{MODEL_NAME}'")}


def _champion(client) -> int:
    return int(client.get_model_version_by_alias(MODEL_NAME, "champion").version)


def test_first_retrain_trains_registers_and_promotes(retrain_scenario, mlflow_client, prefect_api):
    first = retrain_scenario.first
    _assert_ok(first, retrain_scenario)
    retrain_run = _read_flow_run(_flow_run_id(first.stdout))
    assert retrain_run.state.is_completed()
    assert "version 1 promoted to champion" in retrain_run.state.message

    # One MLflow run, the first retrain's (as recorded right after it: later tests add runs and versions).
    assert len(retrain_scenario.first_run_ids) == 1
    run = mlflow_client.get_run(retrain_scenario.first_run_ids[0])
    params = run.data.params
    assert params["strategy"] == "default" and int(params["per_replica_batch_size"]) == 32
    assert int(params["epochs"]) == 1 and params["pipeline"] == "digits-retrain"
    history = mlflow_client.get_metric_history(run.info.run_id, "loss")
    assert len(history) >= 3 and history[-1].value < history[0].value
    assert "final_eval_accuracy" in run.data.metrics

    version = mlflow_client.get_model_version(MODEL_NAME, "1")
    assert version.run_id == run.info.run_id
    assert retrain_scenario.first_champion == "1"
    tags = version.tags
    assert tags[registry.BLESSED_TAG] == "true"
    assert tags[registry.COMPARED_WITH_TAG] == "none"
    assert float(tags[registry.CHALLENGER_SCORE_TAG]) == pytest.approx(run.data.metrics["final_eval_accuracy"])
    assert tags[registry.FINGERPRINT_TAG] == retrain_scenario.first_fingerprint
    # The version names the Prefect runs that made it: the training subflow and the retrain flow.
    assert tags["tfdag.retrain_flow_run_id"] == str(retrain_run.id)
    subflow = _read_flow_run(uuid.UUID(tags["prefect_flow_run_id"]))
    assert subflow.parent_task_run_id is not None and subflow.state.is_completed()

    links = [link for link in _artifacts("digits-retrain-mlflow-run") if run.info.run_id in link.data]
    assert links and retrain_scenario.running.state.mlflow_url in links[0].data
    tables = [table for table in _artifacts("digits-retrain-evaluation-table") if table.flow_run_id in (subflow.id, retrain_run.id)]
    assert tables and tables[0].type == "table" and "accuracy" in str(tables[0].data)


def test_unchanged_data_is_skipped_then_new_rows_make_a_version_and_a_worse_one_is_refused(
        retrain_scenario, mlflow_client, prefect_api, monkeypatch):
    _assert_ok(retrain_scenario.first, retrain_scenario)
    experiment = mlflow_client.get_experiment_by_name("digits-retrain")
    num_runs = len(mlflow_client.search_runs([experiment.experiment_id]))

    # 1. Nothing changed since the champion: no training, a clear message.
    skipped = retrain_scenario.run()
    _assert_ok(skipped, retrain_scenario)
    state = _read_flow_run(_flow_run_id(skipped.stdout)).state
    assert state.is_completed() and state.message.startswith("no new data since version 1")
    assert len(mlflow_client.search_runs([experiment.experiment_id])) == num_runs
    assert set(_versions(mlflow_client)) == {1}

    # 2. New rows: the challenger is compared with the champion on the same new eval split, and registered
    # (as the new champion) only when it beats it.
    retrain_scenario.append_rows(INITIAL_ROWS, INITIAL_ROWS + FIRST_APPEND)
    grown = retrain_scenario.run()
    _assert_ok(grown, retrain_scenario)
    [grown_run] = _runs(mlflow_client, experiment, retrain_scenario.source_fingerprint())
    blessed = grown_run.data.tags["tfdag.blessed"] == "true"
    versions = _versions(mlflow_client)
    assert set(versions) == ({1, 2} if blessed else {1})
    if blessed:
        v2 = versions[2].tags
        assert v2[registry.FINGERPRINT_TAG] == retrain_scenario.source_fingerprint()
        assert v2[registry.COMPARED_WITH_TAG] == "1" and v2[registry.BLESSED_TAG] == "true"
        assert float(v2[registry.CHALLENGER_SCORE_TAG]) > float(v2[registry.CHAMPION_SCORE_TAG])
    assert _champion(mlflow_client) == (2 if blessed else 1)
    champion_before = _champion(mlflow_client)
    num_versions = len(versions)

    # 3. More rows, but a deliberately worse challenger (one training step): not blessed, so not registered;
    # its MLflow run ends FINISHED, tagged tfdag.blessed=false, and the alias stays.
    retrain_scenario.append_rows(INITIAL_ROWS + FIRST_APPEND, len(retrain_scenario.rows) - 1)
    worse = retrain_scenario.run(params={"overrides": {"train.steps": 1}})
    _assert_ok(worse, retrain_scenario)
    state = _read_flow_run(_flow_run_id(worse.stdout)).state
    assert state.is_completed() and "not promoted (not registered)" in state.message
    assert f"champion v{champion_before}" in state.message
    assert len(_versions(mlflow_client)) == num_versions
    assert _champion(mlflow_client) == champion_before
    [worse_run] = _runs(mlflow_client, experiment, retrain_scenario.source_fingerprint())
    assert worse_run.data.tags["tfdag.blessed"] == "false" and worse_run.info.status == "FINISHED"
    assert int(worse_run.data.params["total_steps"]) == 1

    # 4. The same data and config again: the refused run is remembered without a version; nothing trains. The flow
    # is called here, in this process, on the stack's servers: the runs above went through the deployment's worker.
    from flows.retrain import RetrainParameters, retrain

    monkeypatch.setenv("MLFLOW_TRACKING_URI", retrain_scenario.running.state.mlflow_url)
    state = retrain(RetrainParameters(config=str(retrain_scenario.config_path), overrides={"train.steps": 1}),
                    return_state=True)
    assert state.is_completed() and f"no new data since MLflow run {worse_run.info.run_id}" in state.message
    assert len(_versions(mlflow_client)) == num_versions


def _runs(client, experiment, fingerprint: str) -> list:
    return client.search_runs([experiment.experiment_id],
                              filter_string=f"tags.`{registry.FINGERPRINT_TAG}` = '{fingerprint}'")

def test_a_failure_after_the_training_subflow_ends_the_challengers_mlflow_run_failed(tmp_path, prefect_api,
                                                                                      monkeypatch):
    """The subflow ended the run FINISHED; a later retrain stage that raises marks it FAILED with that stage."""
    import yaml
    from mlflow import MlflowClient
    from prefect import task

    from flows import retrain as retrain_flow
    from pipeline_lib.config import load_config
    from pipeline_lib.data import demo as demo_data

    raw = tmp_path / "raw" / "digits.csv"
    demo_data.write_digits_csv(str(raw))
    path = tmp_path / "retrain-failure.yaml"
    path.write_text(yaml.safe_dump({
        "name": "digits-retrain-failure",
        "data": {"source": str(raw), "label": "target", "target_shard_mb": 0.25},
        "output_root": str(tmp_path / "out"),
        "model": {"factory": "mlp", "params": {"hidden_units": [16]}},
        "train": {"strategy": "default", "isolation": "none", "per_replica_batch_size": 64, "steps": 5,
                  "checkpoint_every_steps": 5},
        # 5 steps do not beat the majority class; this test is about a failure after the gate blessed the model.
        "evaluation": {"gate": {"metric": "accuracy", "threshold": None, "beat_baseline": False}},
        "tracking": {"experiment": "retrain-failure", "registered_model": "digits-retrain-failure"},
    }))

    @task(name="record_decision")
    def record_decision(*args, **kwargs):
        raise registry.RegistryError("the registry refused the tags (simulated)")

    monkeypatch.setattr(retrain_flow, "record_decision", record_decision)
    with pytest.raises(registry.RegistryError, match="simulated"):
        retrain_flow.retrain(retrain_flow.RetrainParameters(config=str(path)))

    config = load_config(path)
    client = MlflowClient(tracking_uri=config.mlflow_uri)
    [run] = client.search_runs([client.get_experiment_by_name("retrain-failure").experiment_id])
    assert run.info.status == "FAILED" and run.info.end_time is not None
    assert run.data.tags["tfdag.failed_stage"] == "record_decision"
