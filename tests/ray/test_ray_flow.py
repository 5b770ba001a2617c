"""The training-pipeline flow with `train.launcher: ray`: the train task connects as a Ray driver and trains on
two nodes of the test cluster; the flow ends with a blessed model and nothing of the run left on the cluster."""

from __future__ import annotations

import pytest

from pipeline_lib.config import parse_config
from tests.flows.test_pipeline_flow import digits_config
from tests.ray.conftest import RAY_IP


@pytest.mark.slow
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
