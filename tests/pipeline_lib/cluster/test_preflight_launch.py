"""A multi-worker training run refuses to train when the workers' preflight fingerprints differ."""

from __future__ import annotations

import json
import os

import pytest

from pipeline_lib.launch import local as launcher
from pipeline_lib.launch.errors import WorkerFailed
from pipeline_lib.launch.protocol import LaunchOptions
from tests.conftest import make_plan
from tests.pipeline_lib.launch_support import make_config, write_dataset_on_disk


@pytest.mark.slow
def test_two_worker_run_with_skewed_tensorflow_refuses_to_train(tmp_path):
    manifest = write_dataset_on_disk(str(tmp_path / "data"))
    config = make_config(str(tmp_path), preflight=True, workers=2, strategy="multi_worker_mirrored", steps=20,
                         max_restarts=2)
    plan = make_plan(manifest, num_workers=2, steps=20)
    run_dir = str(tmp_path / "run")
    skew = json.dumps({"task": "worker 1", "tensorflow": "2.13.1"})
    lines: list[str] = []

    with pytest.raises(WorkerFailed) as failed:
        launcher.launch_training(config, manifest, plan, run_dir, options=LaunchOptions(
            log_fn=lines.append, env={"TFDAG_PREFLIGHT_OVERRIDE": skew}))

    message = str(failed.value)
    assert "permanent failure, not restarted" in message
    assert "2.13.1" in message and "tensorflow" in message
    # Both workers fail with the per-worker diff, and nothing was trained.
    log = "\n".join(lines)
    assert "[worker 0]" in log and "[worker 1]" in log and log.count("2.13.1") >= 2
    assert not os.path.exists(os.path.join(run_dir, "checkpoints")) or not os.listdir(
        os.path.join(run_dir, "checkpoints"))
    report = json.loads((tmp_path / "run" / "preflight" / "report.json").read_text())
    assert report
