"""Data validation in the pipeline on the wine table: statistics logged with the run, and a column in other units
stops the next run before training (and `tfdag validate-data` exits 2), unless `validation.allow` accepts it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline_lib.config import load_config
from pipeline_lib.data.validation import DataValidationError
from tests.pipeline_lib.data.wine_support import write_wine_csv

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def _write_config(tmp_path: Path, **extra) -> Path:
    path = tmp_path / "wine.yaml"
    path.write_text(yaml.safe_dump({
        "name": "wine-validation",
        "data": {"source": str(tmp_path / "raw" / "wine.csv"), "label": "cultivar"},
        "output_root": str(tmp_path / "out"),
        # Trained in this process, as the digits example does: what is tested is the validation, not the worker.
        "train": {"isolation": "none", "epochs": 5},  # a few steps (the default ceiling is 100 epochs)
        # No model check (a fresh interpreter per trained run): what is tested is the data's validation; the check
        # is tests/flows/test_pipeline_flow.py's (the shared digits run and the 1-epoch failure path).
        "evaluation": {"validate_model": False},
        "tracking": {"experiment": "wine-validation", "mlflow_uri": f"sqlite:///{tmp_path / 'mlflow.db'}"},
        **extra,
    }))
    return path


def _validate_data(config_path: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "flows.cli", "validate-data", str(config_path)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300, check=False)


def test_drift_stops_the_pipeline_before_training_and_an_allowed_anomaly_trains(tmp_path, prefect_api):
    from mlflow import MlflowClient

    from flows.pipeline import training_pipeline

    (tmp_path / "raw").mkdir()
    write_wine_csv(tmp_path / "raw" / "wine.csv")
    config_path = _write_config(tmp_path)
    config = load_config(config_path)
    first = training_pipeline(config)
    client = MlflowClient(tracking_uri=config.mlflow_uri)
    logged = {f.path for f in client.list_artifacts(first.mlflow_run_id, "data")}
    assert {"data/statistics.json", "data/schema.json", "data/statistics.md"} <= logged
    assert "data/histograms/proline.svg" in {f.path for f in client.list_artifacts(first.mlflow_run_id,
                                                                                     "data/histograms")}
    assert _validate_data(config_path).returncode == 0  # the same data: no anomaly

    # Next month's file: proline in other units (×3).
    write_wine_csv(tmp_path / "raw" / "wine.csv", scale={"proline": 3.0})
    checked = _validate_data(config_path)
    assert checked.returncode == 2, checked.stderr
    [line] = checked.stdout.strip().splitlines()
    assert line.startswith("drift:proline: observed Jensen-Shannon divergence")

    with pytest.raises(DataValidationError, match="drift:proline"):
        training_pipeline(config)
    experiment = client.get_experiment_by_name("wine-validation")
    [stopped] = client.search_runs([experiment.experiment_id], filter_string="attributes.status = 'FAILED'")
    assert stopped.data.tags["tfdag.failed_stage"] == "validate_data"
    assert "num_restarts" not in stopped.data.metrics and "total_steps" not in stopped.data.params  # no training
    anomalies = client.download_artifacts(stopped.info.run_id, "data/anomalies.md", str(tmp_path))
    assert "`proline`" in Path(anomalies).read_text()

    allowed = load_config(_write_config(tmp_path, validation={"allow": ["drift:proline"]}))
    summary = training_pipeline(allowed)
    assert summary.final_step > 0 and summary.metrics["accuracy"] > 0.8

    # A new cellar at a fifth of the rows is reported against the latest successful run (the allowed one).
    write_wine_csv(tmp_path / "raw" / "wine.csv", scale={"proline": 3.0}, new_category_share=0.2)
    checked = _validate_data(config_path)
    assert checked.returncode == 2
    assert any(line.startswith("unseen_values:cellar") for line in checked.stdout.splitlines())
