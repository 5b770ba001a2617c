"""Data validation against the tracked baseline: this conversion's schema and statistics against those of the run
`validation.against` names (found through the tracker)."""

from __future__ import annotations

from pipeline_lib.config import PipelineConfig
from pipeline_lib.data.manifest import Schema
from pipeline_lib.data.statistics import DatasetStatistics
from pipeline_lib.data.validation import ValidationReport, validate_statistics
from pipeline_lib.tracking.records import SCHEMA_ARTIFACT, STATISTICS_ARTIFACT
from pipeline_lib.tracking.tracker import open_tracker


def check_data(config: PipelineConfig, schema: Schema, statistics: DatasetStatistics | None,
               against: str | None = None, exclude_run_id: str | None = None) -> ValidationReport:
    """This conversion's schema and statistics against the baseline (`validation.against` unless `against`).

    No baseline (a first run, tracking disabled, a dataset converted without statistics) gives a report
    without anomalies that says so.

    Raises:
        ConfigError: when the named baseline does not exist (see `Tracker.find_baseline`).
    """
    if statistics is None:
        return ValidationReport(baseline="none: the dataset was converted without statistics")
    if not config.tracking.enabled and against is None:
        return ValidationReport(baseline="none: tracking is disabled, so there is no earlier run to compare with")
    baseline = open_tracker(config).find_baseline(against, exclude_run_id)
    if baseline is None:
        return ValidationReport(baseline=f"none: no earlier successful run of pipeline {config.name!r} logged "
                                         "statistics (this run's become the baseline)")
    return validate_statistics(schema, statistics, baseline.schema_, baseline.statistics, config.validation,
                               baseline.description)


def baseline_artifacts(schema: Schema, statistics: DatasetStatistics) -> dict[str, str]:
    """The run artifacts that make a run a baseline for later ones."""
    return {SCHEMA_ARTIFACT: schema.model_dump_json(indent=2), STATISTICS_ARTIFACT: statistics.to_json()}
