"""The baseline data validation compares with: the schema and statistics an earlier MLflow run logged.

`validation.against` (or `tfdag validate-data --against`) names it: `latest`, the newest FINISHED run of the same
pipeline (the `tfdag.pipeline` tag) that logged statistics; `champion`, the run that produced the registered
model's `champion` version; or an MLflow run id.
"""

from __future__ import annotations

import tempfile

from pipeline_lib.config import ConfigError, PipelineConfig
from pipeline_lib.data.manifest import Schema
from pipeline_lib.data.statistics import DatasetStatistics
from pipeline_lib.tracking.client import create_client
from pipeline_lib.tracking.records import SCHEMA_ARTIFACT, STATISTICS_ARTIFACT, Baseline

PIPELINE_TAG = "tfdag.pipeline"
_SEARCHED_RUNS = 20


def _load(client, run_id: str, description: str) -> Baseline | None:
    from mlflow.exceptions import MlflowException

    with tempfile.TemporaryDirectory(prefix="tfdag-baseline-") as tmp:
        try:
            statistics = client.download_artifacts(run_id, STATISTICS_ARTIFACT, tmp)
            schema = client.download_artifacts(run_id, SCHEMA_ARTIFACT, tmp)
        except (MlflowException, OSError):
            return None
        with open(statistics, "rb") as handle:
            stats = DatasetStatistics.model_validate_json(handle.read())
        with open(schema, "rb") as handle:
            schema_value = Schema.model_validate_json(handle.read())
    return Baseline(run_id=run_id, description=description, schema_=schema_value, statistics=stats)


def _latest(client, config: PipelineConfig, exclude_run_id: str | None) -> Baseline | None:
    experiment = client.get_experiment_by_name(config.tracking.experiment)
    if experiment is None:
        return None
    runs = client.search_runs(
        [experiment.experiment_id], max_results=_SEARCHED_RUNS, order_by=["attributes.start_time DESC"],
        filter_string=f"tags.`{PIPELINE_TAG}` = '{config.name}' and attributes.status = 'FINISHED'")
    for run in runs:
        if run.info.run_id == exclude_run_id:
            continue
        found = _load(client, run.info.run_id,
                      f"run {run.info.run_id} (the latest successful run of pipeline {config.name!r})")
        if found is not None:
            return found
    return None


def find_baseline(config: PipelineConfig, against: str | None = None,
                  exclude_run_id: str | None = None) -> Baseline | None:
    """The baseline's schema and statistics, or None when there is none yet (a first run: nothing to compare).

    Args:
        config: the pipeline config (tracking, name, validation.against).
        against: `latest`, `champion` or a run id; default `validation.against`.
        exclude_run_id: the current run, never its own baseline.

    Raises:
        ConfigError: for `champion` without tracking.registered_model or a champion, or a run id that does not
            exist or logged no statistics.
    """
    from mlflow.exceptions import MlflowException

    against = against or config.validation.against
    client = create_client(config.mlflow_uri)
    if against == "latest":
        return _latest(client, config, exclude_run_id)
    if against == "champion":
        name = config.tracking.registered_model
        if not name:
            raise ConfigError("validation against 'champion' needs tracking.registered_model; set it, or validate "
                              "against 'latest' or a run id")
        from pipeline_lib.tracking.registry import get_champion

        champion = get_champion(config.mlflow_uri, name)
        if champion is None or champion.run_id is None:
            raise ConfigError(f"registered model {name!r} has no 'champion' version to validate against; train and "
                              "bless one first, or validate against 'latest'")
        found = _load(client, champion.run_id, f"run {champion.run_id} (the champion, {name} v{champion.version})")
        if found is None:
            raise ConfigError(f"the champion's run {champion.run_id} logged no {STATISTICS_ARTIFACT}; it predates data "
                              "validation: validate against 'latest' until a new champion is blessed")
        return found
    try:
        client.get_run(against)
    except MlflowException:
        raise ConfigError(f"validation against {against!r}: no MLflow run with that id at {config.mlflow_uri_shown}; "
                          "pass 'latest', 'champion' or the id of a run of this pipeline") from None
    found = _load(client, against, f"run {against}")
    if found is None:
        raise ConfigError(f"MLflow run {against} logged no {STATISTICS_ARTIFACT}; pass a run that converted data "
                          "with statistics, or 'latest'")
    return found
