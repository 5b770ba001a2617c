"""The training-pipeline flow with `train.launcher: ray`: the train task connects as a Ray driver and trains on
two nodes of the test cluster; the flow ends with a blessed model and nothing of the run left on the cluster."""

from __future__ import annotations

import os

import pytest

from pipeline_lib.config import parse_config
from tests.flows.test_pipeline_flow import digits_config
from tests.ray.conftest import RAY_IP


# The same flow on Ray, with a raylet killed mid-run, is test_ray_launcher.py's raylet test, which asserts all of
# this too (blessed, FINISHED, two workers, nothing left on the cluster): this plain run is its duplicate.
@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("TFDAG_RAY_FAULT_MATRIX") != "full",
                    reason="test_ray_launcher.py's raylet test runs this flow on Ray and asserts the same: "
                           "TFDAG_RAY_FAULT_MATRIX=full runs this duplicate too")
def test_the_pipeline_flow_trains_on_ray_through_the_train_task(tmp_path, prefect_api, ray_cluster):
    from mlflow.tracking import MlflowClient

    from flows.pipeline import training_pipeline

    values = digits_config(tmp_path, strategy="multi_worker_mirrored", cpu_replicas=None, workers=2, epochs=3,
                           base_learning_rate=0.01, launcher="ray",
                           ray={"address": ray_cluster.address, "node_ip_address": RAY_IP})
    config = parse_config(values)
    summary = training_pipeline(config)
    assert summary.metrics["accuracy"] >= 0.9 and summary.blessed
    run = MlflowClient(tracking_uri=config.mlflow_uri).get_run(summary.mlflow_run_id)
    assert run.info.status == "FINISHED" and int(run.data.params["num_workers"]) == 2
    assert ray_cluster.alive_actors() == [] and ray_cluster.live_placement_groups() == []


# A trial's Ray launch is launch_on_ray as in test_ray_launcher.py (its environment reaching the worker processes
# among it), and a trial's reports, pruning and resume are the study's, checked on the local launcher by
# tests/flows/test_tune_flow.py: this run on Ray is their sum.
@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("TFDAG_RAY_FAULT_MATRIX") != "full",
                    reason="test_ray_launcher.py's Ray launches and test_tune_flow.py's studies check its parts: "
                           "TFDAG_RAY_FAULT_MATRIX=full runs this too")
def test_a_study_trains_its_trials_on_ray(tmp_path, prefect_api, ray_cluster):
    """The same tune flow with `train.launcher: ray`: each trial a Ray launch on the test cluster, its chief
    reporting to the study (a journal file every node of this one-machine cluster reaches)."""
    from flows.tune import tune_pipeline
    from tests.flows.test_tune_flow import load_study, study_config

    values = study_config(tmp_path, "digits-tune-ray", trials=2, parallel=1, pruner="none")
    values["train"].update(launcher="ray", ray={"address": ray_cluster.address, "node_ip_address": RAY_IP})
    summary = tune_pipeline(parse_config(values))
    assert summary.trials == {"complete": 2, "pruned": 0, "failed": 0}
    assert summary.model is not None and summary.model.blessed and summary.model.model_version == "1"
    trials = load_study(values).trials
    assert [t.user_attrs["tfdag.train_result"]["final_step"] for t in trials] == [40, 40]
    assert ray_cluster.alive_actors() == [] and ray_cluster.live_placement_groups() == []
