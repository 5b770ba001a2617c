"""`tfdag reproduce RUN_ID` on a deterministic digits run (shuffling, dropout, Adam): the record the pipeline
logs, exit 0 with bit-identical weights, and exit 1 naming the difference once one recorded input changes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline_lib.config import parse_config
from pipeline_lib.tracking import reproducibility
from tests.flows.conftest import digits_run_config

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def _reproduce(config, run_id: str, *extra: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG", "MLFLOW_TRACKING_URI")}
    return subprocess.run([sys.executable, "-m", "flows.cli", "reproduce", run_id, "--tracking-uri",
                           config.mlflow_uri, *extra], cwd=ROOT, env=environ, capture_output=True, text=True,
                          timeout=600, check=False)


@pytest.fixture
def tracked_run(digits_run, tmp_path):
    """The session's shared deterministic run (tests/flows/conftest.py); a reproduction's work dir in this test's
    tmp folder."""
    return tmp_path, digits_run.config, digits_run.summary


def _replace_artifact(config, run_id: str, path: str, content: str) -> None:
    from mlflow import MlflowClient

    MlflowClient(tracking_uri=config.mlflow_uri).log_text(run_id, content, path)


def _artifact(config, run_id: str, path: str, tmp_path: Path) -> str:
    from mlflow import MlflowClient

    local = MlflowClient(tracking_uri=config.mlflow_uri).download_artifacts(run_id, path, str(tmp_path))
    return Path(local).read_text()


def test_the_run_records_everything_a_rerun_needs(tracked_run, tmp_path):
    from mlflow import MlflowClient

    _, config, summary = tracked_run
    run = MlflowClient(tracking_uri=config.mlflow_uri).get_run(summary.mlflow_run_id)
    params = run.data.params
    assert params["deterministic"] == "True" and params["shuffle"] == "True" and params["jit_compile"] == "False"
    assert params["seed"] == "7" and params["split_seed"] == "0"
    record = json.loads(_artifact(config, summary.mlflow_run_id, reproducibility.RECORD_ARTIFACT, tmp_path))
    assert record["strategy"] == "mirrored" and record["num_workers"] == 1 and record["num_replicas"] == 2
    assert record["data_fingerprint"] == summary.data_fingerprint and len(record["manifest_hash"]) == 64
    assert record["seed"] == 7 and record["deterministic"] is True
    freeze = _artifact(config, summary.mlflow_run_id, reproducibility.PIP_FREEZE_ARTIFACT, tmp_path)
    assert any(line.startswith("tensorflow==2.21") for line in freeze.splitlines())
    build = json.loads(_artifact(config, summary.mlflow_run_id, reproducibility.TF_BUILD_ARTIFACT, tmp_path))
    assert build["tensorflow_version"].startswith("2.21") and "build_info" in build


def test_reproduce_exits_0_with_bit_identical_weights(tracked_run):
    tmp_path, config, summary = tracked_run
    out = _reproduce(config, summary.mlflow_run_id, "--work-dir", str(tmp_path / "rerun"))
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    assert f"tfdag | reproduced run {summary.mlflow_run_id}: bit-identical weights" in out.stdout


def test_a_changed_seed_in_the_recorded_config_exits_1_naming_each_variable(tracked_run, tmp_path):
    _, config, summary = tracked_run
    recorded = yaml.safe_load(_artifact(config, summary.mlflow_run_id, reproducibility.CONFIG_ARTIFACT, tmp_path))
    changed = {**recorded, "train": {**recorded["train"], "seed": 8}}
    _replace_artifact(config, summary.mlflow_run_id, reproducibility.CONFIG_ARTIFACT, yaml.safe_dump(changed))
    try:
        out = _reproduce(config, summary.mlflow_run_id, "--work-dir", str(tmp_path / "rerun"))
    finally:
        _replace_artifact(config, summary.mlflow_run_id, reproducibility.CONFIG_ARTIFACT,
                          yaml.safe_dump(recorded, sort_keys=False))
    assert out.returncode == 1, (out.stdout + out.stderr)[-4000:]
    assert "are not bit-identical; largest difference per variable:" in out.stdout
    assert "tfdag |   dense_0/kernel: " in out.stdout and "tfdag |   logits/bias: " in out.stdout


def test_a_changed_data_row_exits_1_naming_the_fingerprint(tracked_run, tmp_path):
    _, config, summary = tracked_run
    # The recorded TFRecords are gone and one row of the source changed: converting again gives other data.
    work, data_dir = tmp_path / "work", os.path.join(config.output_root, "data")
    shutil.copytree(data_dir, work / "data_backup")
    shutil.rmtree(os.path.join(data_dir, summary.data_fingerprint))
    source = Path(config.data.source)
    original = source.read_text()
    lines = original.splitlines(keepends=True)
    lines[1] = lines[1].replace("0", "1", 1)
    source.write_text("".join(lines))
    try:
        out = _reproduce(config, summary.mlflow_run_id, "--work-dir", str(work))
    finally:
        source.write_text(original)
        shutil.copytree(work / "data_backup", data_dir, dirs_exist_ok=True)
    assert out.returncode == 1, (out.stdout + out.stderr)[-4000:]
    assert "NOT reproduced" in out.stdout and "is missing" in out.stdout
    assert f"data fingerprint: the run recorded {summary.data_fingerprint}, converting data.source" in out.stdout


def test_a_run_that_was_not_deterministic_is_refused(tracked_run, tmp_path):
    _, config, summary = tracked_run
    original = _artifact(config, summary.mlflow_run_id, reproducibility.RECORD_ARTIFACT, tmp_path)
    _replace_artifact(config, summary.mlflow_run_id, reproducibility.RECORD_ARTIFACT,
                      json.dumps({**json.loads(original), "deterministic": False}))
    try:
        out = _reproduce(config, summary.mlflow_run_id)
    finally:
        _replace_artifact(config, summary.mlflow_run_id, reproducibility.RECORD_ARTIFACT, original)
    assert out.returncode == 2, (out.stdout + out.stderr)[-4000:]
    assert "train.deterministic: false" in out.stderr and "--tolerance" in out.stderr


def test_reproduce_a_two_worker_multi_worker_mirrored_run_exits_0(tmp_path, prefect_api):
    """Its own run: the shared run is mirrored in one process; 1 epoch, what a bit-identical comparison needs."""
    from flows.pipeline import training_pipeline

    config = parse_config(digits_run_config(tmp_path, strategy="multi_worker_mirrored", cpu_replicas=None,
                                            workers=2, epochs=1))
    summary = training_pipeline(config)
    assert summary.strategy == "multi_worker_mirrored" and summary.num_workers == 2
    out = _reproduce(config, summary.mlflow_run_id, "--work-dir", str(tmp_path / "rerun"))
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    assert "bit-identical weights" in out.stdout and "(multi_worker_mirrored, 2 worker(s))" in out.stdout
