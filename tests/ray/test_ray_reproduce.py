"""`reproduce` of a Ray run reruns it on Ray (the launcher its recorded config names), with bit-identical weights.

A tiny deterministic run (one worker, a few steps) trains on the session's Ray cluster (tests/ray/conftest.py) and
is recorded in a sqlite MLflow store as the pipeline records it (`tracking.reproducibility`); the rerun must train
in a Ray actor again: its workers' lines carry the `[worker 0 @ <node ip>]` prefix only the Ray launcher writes.
"""

from __future__ import annotations

import pytest

from pipeline_lib.evaluation.consolidation import restore_model
from pipeline_lib.launch import launchers
from pipeline_lib.reproduce.rerun import reproduce
from pipeline_lib.tracking import reproducibility
from pipeline_lib.tracking import run as tracking_run
from tests.pipeline_lib.launch_support import (
    LogCapture,
    make_config,
    plan_for,
    write_dataset_on_disk,
)
from tests.ray.conftest import RAY_IP

pytestmark = pytest.mark.slow

STEPS = 6
RAY_PREFIX = f"[worker 0 @ {RAY_IP}] "  # ray_launcher.RayTaskHandle's; the local launcher writes "[worker 0] "


def _record_run(config, manifest, plan, result) -> str:
    """Log what the pipeline's `track` stage logs for a rerun (flows.pipeline) into a new MLflow run."""
    final = result.checkpoints[-1]
    record = reproducibility.build_record(config, result, plan, manifest, final.step, "latest")
    weights = reproducibility.model_weights(restore_model(config, manifest, final))
    run_id = tracking_run.start_run(config, "ray-run")
    tracking_run.log_artifacts(run_id, config.mlflow_uri, {
        reproducibility.CONFIG_ARTIFACT: config.masked_yaml(),
        reproducibility.MANIFEST_ARTIFACT: manifest.to_json(),
        reproducibility.SHARD_PLAN_ARTIFACT: plan.model_dump_json(indent=2),
        **reproducibility.reproduction_artifacts(record, weights)})
    tracking_run.finish_run(run_id, config.mlflow_uri)
    return run_id


def test_reproducing_a_ray_run_reruns_it_on_ray_with_bit_identical_weights(ray_cluster, tmp_path):
    manifest = write_dataset_on_disk(str(tmp_path / "data"), num_train=128, num_eval=32)
    config = make_config(
        str(tmp_path / "out"), launcher="ray", strategy="default", deterministic=True, shuffle=True, seed=3,
        checkpoint_every_steps=STEPS, log_every_steps=STEPS, hang_timeout_s=60.0, max_restarts=0,
        ray={"address": ray_cluster.address, "node_ip_address": RAY_IP, "placement_timeout_s": 30},
        tracking={"mlflow_uri": f"sqlite:///{tmp_path}/mlflow.db", "experiment": "ray-reproduce"})
    plan = plan_for(manifest, config, steps=STEPS)
    first = LogCapture()
    result = launchers.launch_training(config, manifest, plan, str(tmp_path / "run"),
                                       options=launchers.LaunchOptions(log_fn=first))
    assert result.final_step == STEPS and RAY_PREFIX in first.text
    run_id = _record_run(config, manifest, plan, result)

    rerun = LogCapture()
    outcome = reproduce(run_id, config.mlflow_uri, work_dir=str(tmp_path / "rerun"), log_fn=rerun)

    assert outcome.launcher == "ray" and RAY_PREFIX in rerun.text, rerun.text[-3000:]
    assert outcome.reproduced and outcome.identical and outcome.differences == {}, outcome.report_lines()
    assert outcome.export_step == STEPS and outcome.num_variables > 0
    assert ray_cluster.alive_actors() == []  # the rerun's actors ended with it
