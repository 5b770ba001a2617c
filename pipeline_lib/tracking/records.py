"""The records the tracking interface passes around, whatever the backend: how a run ends, a logged model, a
registered version, a data validation baseline, and the tag names the flows read."""

from __future__ import annotations

import enum

from pydantic import BaseModel, ConfigDict

from pipeline_lib.core.errors import TransientError, UserError
from pipeline_lib.data.manifest import Schema
from pipeline_lib.data.statistics import DatasetStatistics

FINAL_METRIC_PREFIX = "final_eval_"
BASELINE_METRIC_PREFIX = "baseline."  # the trivial predictor's metrics on the same eval split (`evaluation.trivial`)
CHAMPION_ALIAS = "champion"
# The artifacts that make a run a later run's data validation baseline.
STATISTICS_ARTIFACT = "data/statistics.json"
SCHEMA_ARTIFACT = "data/schema.json"
# Model-version tags: the data and config a version trained on (the retrain flow's new-data check), the blessing.
FINGERPRINT_TAG = "tfdag.source_fingerprint"
CONFIG_HASH_TAG = "tfdag.config_hash"
BLESSED_TAG = "blessed"
# A tuning study's runs: the study, the trial, and the run a trial's (or the best model's) run is nested under
# (MLflow's own tag: its UI nests the run under its parent).
STUDY_TAG = "tfdag.tune.study"
TRIAL_TAG = "tfdag.tune.trial"
PARENT_TAG = "mlflow.parentRunId"


class TrackingError(UserError, RuntimeError):
    """The tracking store cannot be used as configured; the message names the value, where it came from and the
    fix."""


class TrackingUnreachable(TransientError):
    """The tracking server stopped answering while a run was logging to it: worth a retry, then a resume."""


class RunStatus(str, enum.Enum):
    """How a tracked run ends."""

    FINISHED = "FINISHED"
    FAILED = "FAILED"
    KILLED = "KILLED"


def run_status(status: RunStatus | str) -> RunStatus:
    """`status` as a RunStatus.

    Raises:
        TrackingError: for a status other than FINISHED, FAILED or KILLED.
    """
    name = str(getattr(status, "value", status)).upper()
    if name not in RunStatus.__members__:
        raise TrackingError(f"run status {name!r} is not one of {list(RunStatus.__members__)}")
    return RunStatus(name)


class LoggedModel(BaseModel):
    """A model logged to its run, not (yet) registered."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model_uri: str  # what the store loads it by (MLflow: models:/<model_id>)
    model_id: str
    run_id: str
    flavor: str = "python_function"


class ModelVersionInfo(BaseModel):
    """A model version just registered."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    version: int
    model_uri: str  # models:/<name>/<version>
    logged_model_uri: str  # the run's logged model
    run_id: str
    flavor: str  # "python_function"


class VersionInfo(BaseModel):
    """A registered model version with the tags the retrain flow reads."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    version: int
    run_id: str | None
    tags: dict[str, str]
    aliases: tuple[str, ...] = ()

    @property
    def source_fingerprint(self) -> str | None:
        return self.tags.get(FINGERPRINT_TAG)

    @property
    def blessed(self) -> bool | None:
        value = self.tags.get(BLESSED_TAG)
        return None if value is None else value.lower() == "true"


class Baseline(BaseModel):
    """The schema and statistics an earlier run logged, which data validation compares with."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    run_id: str
    description: str
    schema_: Schema
    statistics: DatasetStatistics
