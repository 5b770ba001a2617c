"""`prefect deployment run 'batch-predict/champion' --watch` on the session's stack: the retrain scenario's champion
scores a table on the process worker, and the output records the version that scored it."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from pipeline_lib.prediction import tables
from tests.flows.conftest import MODEL_NAME
from tests.flows.test_retrain import (
    _artifacts,
    _assert_ok,
    _flow_run_id,
    _read_flow_run,
)
from tests.servers import prefect_cli

pytestmark = pytest.mark.slow


# ~20 s: a flow-run process on the worker (Python, Prefect and TensorFlow start) that downloads the champion.
def test_the_deployment_scores_a_table_with_the_champion(retrain_scenario, mlflow_client, prefect_api, tmp_path):
    _assert_ok(retrain_scenario.first, retrain_scenario)  # the first retrain registered and promoted a champion
    source = tmp_path / "digits.csv"
    source.write_text("".join(retrain_scenario.rows[:301]))  # the header and 300 rows
    output = tmp_path / "predictions" / "digits.parquet"
    params = {"model": f"models:/{MODEL_NAME}@champion", "input": str(source), "output": str(output),
              "keep": ["target"], "batch_rows": 128}
    run = prefect_cli(retrain_scenario.running, "deployment", "run", "batch-predict/champion", "--watch",
                      "--param", f"params={json.dumps(params)}")
    _assert_ok(run, retrain_scenario)
    flow_run = _read_flow_run(_flow_run_id(run.stdout))
    assert flow_run.state.is_completed() and flow_run.deployment_id is not None

    champion = int(mlflow_client.get_model_version_by_alias(MODEL_NAME, "champion").version)
    record = tables.read_metadata(str(output))
    assert (record["model"]["name"], record["model"]["version"], record["rows"]) == (MODEL_NAME, champion, 300)
    assert record["model"]["run_id"] == mlflow_client.get_model_version(MODEL_NAME, str(champion)).run_id
    scored = pd.read_parquet(output)
    assert list(scored.columns[:2]) == ["target", "prediction"] and len(scored) == 300
    assert (scored["prediction"].astype(str) == scored["target"].astype(str)).mean() > 0.8  # a trained model
    (artifact,) = [a for a in _artifacts("batch-predict") if a.flow_run_id == flow_run.id]
    assert f"{MODEL_NAME} version {champion}" in artifact.data and "300 rows" in artifact.data
