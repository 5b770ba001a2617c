"""The evaluation a reviewer reads: metrics per slice and their gate, the plots, on data where one slice is clearly
worse than the rest (the labels of region "south" are noise)."""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pipeline_lib.config import parse_config
from tests.flows.browser import dump_dom, require_chromium, screenshot


def write_regions_csv(path: Path, num_rows: int = 1500, seed: int = 5) -> None:
    """Four numeric features, a `region` string column and a 3-class label that depends on the features — except
    in the south (a fifth of the rows), where it is random."""
    rng = np.random.default_rng(seed)
    weights = np.array([[2.0, -1.0, 0.0], [-1.0, 2.0, 0.0], [0.0, -1.0, 2.0], [1.0, 1.0, -2.0]])
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["f0", "f1", "f2", "age", "region", "label"])
        for _ in range(num_rows):
            x = rng.normal(size=4)
            region = rng.choice(["north", "east", "west", "south"], p=[0.3, 0.25, 0.25, 0.2])
            label = int(rng.integers(0, 3)) if region == "south" else int(np.argmax(x @ weights))
            age = float(rng.integers(16, 80))
            writer.writerow([f"{x[0]:.5f}", f"{x[1]:.5f}", f"{x[2]:.5f}", f"{age:g}", region, label])


def regions_config(tmp_path: Path) -> dict:
    raw = tmp_path / "raw" / "regions.csv"
    write_regions_csv(raw)
    return {
        "name": "regions-slices",
        "data": {"source": str(raw), "label": "label", "target_shard_mb": 0.1},
        "output_root": str(tmp_path / "out"),
        "model": {"factory": "mlp", "num_classes": 3, "params": {"hidden_units": [32]}},
        "train": {"strategy": "default", "per_replica_batch_size": 32, "base_learning_rate": 0.01, "epochs": 12,
                  "checkpoint_every_steps": 100, "log_every_steps": 50, "seed": 3},
        "evaluation": {
            "slices": [["region"], {"feature": "age", "boundaries": [35, 65]}],
            "gate": {"metric": "accuracy", "threshold": 0.5, "slice_threshold": 0.6, "min_slice_examples": 20},
            # No model check (a fresh TensorFlow+MLflow interpreter): this record is about slices and plots; the
            # check is tests/flows/test_pipeline_flow.py's.
            "validate_model": False,
        },
        "tracking": {"experiment": "slices-test", "registered_model": "regions-slices"},
    }


@dataclass(frozen=True)
class SlicedRun:
    summary: Any
    config: Any
    mlflow_url: str


@pytest.fixture(scope="session")  # session: torn down once, whatever runs between its tests (its group keeps them in one process)
def sliced_run(tfdag_stack, prefect_api, tmp_path_factory) -> SlicedRun:
    """One pipeline run on the regions data, tracked on the session's MLflow server and registered although not
    blessed (`tracking.register: always`), so that the UI has a run and a model version to show."""
    from flows.pipeline import training_pipeline

    data = regions_config(tmp_path_factory.mktemp("regions"))
    data["tracking"].update({"mlflow_uri": tfdag_stack.state.mlflow_url, "register": "always"})
    config = parse_config(data)
    return SlicedRun(training_pipeline(config), config, tfdag_stack.state.mlflow_url)


@pytest.mark.slow
def test_a_clearly_worse_slice_fails_the_gate_by_name_and_the_record_shows_slices_and_plots(sliced_run, tmp_path):
    from mlflow.tracking import MlflowClient

    summary, config = sliced_run.summary, sliced_run.config
    # Good overall, bad in the south: not blessed, and the reason names the slice.
    assert summary.metrics["accuracy"] >= 0.6, summary.metrics
    assert not summary.blessed and summary.gate.failing_slices == ("region=south",), summary.gate.reason
    assert "region=south" in summary.gate.reason and "slice_threshold" in summary.gate.reason

    client = MlflowClient(tracking_uri=config.mlflow_uri)
    run = client.get_run(summary.mlflow_run_id)
    metrics = run.data.metrics
    assert metrics["slice.region:south.accuracy"] < 0.6 <= metrics["slice.region:north.accuracy"], metrics
    assert metrics["slice.region:south.num_examples"] >= 20
    assert {"slice.age:_35.accuracy", "slice.age:_35_65_.accuracy", "slice.age:_65.accuracy"} <= set(metrics)
    assert run.data.tags["tfdag.blessed"] == "false"
    # Registered only because of `register: always`, tagged as not blessed.
    version = client.get_model_version("regions-slices", summary.model_version)
    assert version.tags["blessed"] == "false" and not version.aliases

    names = {a.path for a in client.list_artifacts(run.info.run_id, "evaluation")}
    assert {"evaluation/slices.json", "evaluation/slices.md", "evaluation/plots"} <= names
    plot_names = {a.path for a in client.list_artifacts(run.info.run_id, "evaluation/plots")}
    assert plot_names == {f"evaluation/plots/{n}.png" for n in ("confusion_matrix", "roc", "precision_recall",
                                                                 "calibration")}
    local = client.download_artifacts(run.info.run_id, "evaluation/slices.md", str(tmp_path / "dl"))
    text = Path(local).read_text()
    assert "| region=south ✗ |" in text and "## age (buckets 35, 65)" in text


@pytest.mark.slow
def test_the_mlflow_ui_shows_the_blessing_the_slices_and_the_confusion_matrix(sliced_run, tmp_path):
    """Headless Chromium on the run page, its artifacts and the model version page; screenshots are kept under
    the test's output (tmp_path/screenshots)."""
    chromium = require_chromium()
    summary = sliced_run.summary
    from mlflow.tracking import MlflowClient

    from pipeline_lib.tracking import run as tracking_run

    client = MlflowClient(tracking_uri=sliced_run.mlflow_url)
    run = client.get_run(summary.mlflow_run_id)
    base = f"{sliced_run.mlflow_url}/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}"
    shots = tmp_path / "screenshots"
    # One browser profile for every page: its cache keeps the MLflow UI's scripts (and V8's compiled code) from one
    # page to the next; every page's data still comes from the tracking server's REST API.
    profile = str(tmp_path / "profile")
    experiment = f"{sliced_run.mlflow_url}/#/experiments/{run.info.experiment_id}?workflowType=machine_learning"
    assert tracking_run.run_ui_url(sliced_run.mlflow_url, run.info.run_id) == f"{base}?workflowType=machine_learning"
    pages = {
        # The experiment in MLflow's model-training view: its runs table (with the run and its dataset), no GenAI
        # pages such as Judges in the sidebar.
        "experiment": (experiment, [run.info.run_name, "regions-slices-train", "Model registry"]),
        "run": (base, ["tfdag.blessed", "regions-slices"]),
        "slices": (f"{base}/artifacts/evaluation/slices.md", ["slices.md", "region=south"]),
        "confusion_matrix": (f"{base}/artifacts/evaluation/plots/confusion_matrix.png",
                             ["confusion_matrix.png", "<img"]),
        "model_version": (f"{sliced_run.mlflow_url}/#/models/regions-slices/versions/{summary.model_version}",
                          ["blessed", "false"]),
    }
    for name, (url, expected) in pages.items():
        dom = ""
        for budget_ms in (15000, 40000):
            dom = dump_dom(chromium, url, profile, budget_ms)
            if all(text in dom for text in expected):
                break
        missing = [text for text in expected if text not in dom]
        assert not missing, f"{url} does not show {missing}; page text starts:\n{dom[:3000]}"
        if name == "experiment":
            assert "Judges" not in dom, "the experiment opened in MLflow's GenAI view"
        screenshot(chromium, url, profile, shots / f"{name}.png")
        assert (shots / f"{name}.png").stat().st_size > 10_000
