"""Headless Chromium opens the MLflow UI on the retrain run: the page shows the run's metric names."""

from __future__ import annotations

import pytest

from tests.flows.browser import dump_dom, require_chromium

pytestmark = pytest.mark.slow

def test_mlflow_ui_shows_the_runs_metric_names(retrain_scenario, mlflow_client, tmp_path):
    chromium = require_chromium()
    assert retrain_scenario.first.returncode == 0, retrain_scenario.first.stdout[-3000:]
    experiment = mlflow_client.get_experiment_by_name("digits-retrain")
    run = mlflow_client.search_runs([experiment.experiment_id], order_by=["attributes.start_time ASC"])[0]
    base = retrain_scenario.running.state.mlflow_url
    url = f"{base}/#/experiments/{experiment.experiment_id}/runs/{run.info.run_id}"
    expected = {"loss", "checkpoint/eval_accuracy", "final_eval_accuracy"} | {name for name in run.data.metrics if name.startswith("final_eval_")}
    assert expected <= set(run.data.metrics)

    # The UI renders in the browser from the REST API; give the page more virtual time when it is not there yet.
    dom = ""
    for budget_ms in (15000, 40000):
        dom = dump_dom(chromium, url, str(tmp_path / f"profile-{budget_ms}"), budget_ms)
        if all(name in dom for name in expected):
            break
    missing = sorted(name for name in expected if name not in dom)
    assert not missing, f"the MLflow run page {url} does not show {missing}; page text starts:\n{dom[:3000]}"
    assert run.info.run_name in dom
