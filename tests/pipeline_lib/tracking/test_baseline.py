"""Tests for pipeline_lib.tracking.baseline: which earlier run's statistics data validation compares with."""

from __future__ import annotations

import pytest

from pipeline_lib.config import ConfigError
from pipeline_lib.data.convert import convert
from pipeline_lib.data.statistics import load_statistics
from pipeline_lib.tracking import baseline, data_check, run
from pipeline_lib.tracking.client import create_client
from tests.pipeline_lib.data.wine_support import write_wine_csv
from tests.pipeline_lib.tracking.conftest import tracking_config


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("baseline_data")
    manifests = {}
    for name, changes in (("wine", {}), ("scaled", {"scale": {"proline": 3.0}})):
        config = tracking_config(root).data.model_copy(
            update={"source": write_wine_csv(root / f"{name}.csv", **changes), "label": "cultivar",
                    "storage_options": {}})
        manifest = convert(config, str(root / "out"))
        manifests[name] = (manifest.feature_schema, load_statistics(manifest))
    return manifests


def _logged_run(config, schema, statistics, status="FINISHED", artifacts=True) -> str:
    run_id = run.start_run(config, "r")
    if artifacts:
        run.log_artifacts(run_id, config.mlflow_uri, data_check.baseline_artifacts(schema, statistics))
    run.finish_run(run_id, config.mlflow_uri, status)
    return run_id


def test_latest_is_the_newest_finished_run_of_the_pipeline_with_statistics(tmp_path, converted):
    config = tracking_config(tmp_path)
    schema, statistics = converted["wine"]
    report = data_check.check_data(config, schema, statistics)
    assert report.anomalies == () and report.baseline.startswith("none: no earlier successful run")
    good = _logged_run(config, schema, statistics)
    _logged_run(config, *converted["scaled"], status="FAILED")  # a failed run is never a baseline
    _logged_run(config, schema, statistics, artifacts=False)  # nor one without statistics
    other = config.model_copy(update={"name": "another-pipeline"})
    _logged_run(other, *converted["scaled"])  # nor another pipeline's
    found = baseline.find_baseline(config)
    assert found.run_id == good and "latest successful run of pipeline 'demo'" in found.description
    assert baseline.find_baseline(config, exclude_run_id=good) is None
    scaled = data_check.check_data(config, *converted["scaled"])
    assert [a.name for a in scaled.blocking] == ["drift:proline"] and good in scaled.baseline


def test_a_run_id_or_the_champion(tmp_path, converted):
    config = tracking_config(tmp_path)
    schema, statistics = converted["wine"]
    run_id = _logged_run(config, schema, statistics)
    assert baseline.find_baseline(config, run_id).run_id == run_id
    with pytest.raises(ConfigError, match=r"no MLflow run with that id"):
        baseline.find_baseline(config, "0123456789abcdef")
    with pytest.raises(ConfigError, match=r"'tiny' has no 'champion' version"):
        baseline.find_baseline(config, "champion")
    client = create_client(config.mlflow_uri)
    client.create_registered_model("tiny")
    version = client.create_model_version("tiny", f"runs:/{run_id}/model", run_id=run_id)
    client.set_registered_model_alias("tiny", "champion", version.version)
    champion = baseline.find_baseline(config, "champion")
    assert champion.run_id == run_id and "the champion, tiny v1" in champion.description
    unregistered = config.model_copy(update={"tracking": config.tracking.model_copy(
        update={"registered_model": None})})
    with pytest.raises(ConfigError, match=r"needs tracking.registered_model"):
        baseline.find_baseline(unregistered, "champion")
