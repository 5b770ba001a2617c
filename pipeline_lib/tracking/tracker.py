"""The tracking interface every caller uses: a `Tracker` (one store) and the `TrackedRun`s it starts, with the one
factory, `open_tracker(config)`, that picks the implementation by the tracking URI's scheme.

MLflow (`tracking.mlflow_backend`) is the default for every URI; another store is one class and one
`register_tracker(scheme, factory)` line. No caller outside `pipeline_lib.tracking` names a backend.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

from pipeline_lib.tracking.records import (  # noqa: F401 - the interface's records, re-exported for its callers
    BASELINE_METRIC_PREFIX,
    BLESSED_TAG,
    CHAMPION_ALIAS,
    CONFIG_HASH_TAG,
    FINAL_METRIC_PREFIX,
    FINGERPRINT_TAG,
    PARENT_TAG,
    STUDY_TAG,
    TRIAL_TAG,
    Baseline,
    LoggedModel,
    ModelVersionInfo,
    RunStatus,
    TrackingError,
    VersionInfo,
    run_status,
)

if TYPE_CHECKING:
    import optuna
    import pandas as pd

    from pipeline_lib.config import PipelineConfig
    from pipeline_lib.data.manifest import Manifest, SourceFingerprint
    from pipeline_lib.evaluation.report import GateDecision
    from pipeline_lib.evaluation.slicing import SliceResult
    from pipeline_lib.serving.validation import ModelValidation
    from pipeline_lib.training.hooks import MetricsSink

class TrackedRun(Protocol):
    """One run in the tracking store: what a pipeline run (or a trial) records while it runs, and how it ends."""

    run_id: str

    def end(self, status: RunStatus | str = RunStatus.FINISHED, *, failed_stage: str | None = None) -> None:
        """End the run FINISHED, FAILED or KILLED; a run that did not finish names the stage that raised."""

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Params (credential-like names and option mappings dropped); the same value again is allowed."""

    def log_metrics(self, metrics: Mapping[str, float], *, prefix: str = FINAL_METRIC_PREFIX, step: int = 0) -> None:
        """Result metrics as `<prefix><name>` (NaN skipped): the final evaluation, or the baseline's."""

    def log_slice_metrics(self, slices: Sequence[SliceResult]) -> None:
        """Each slice's metrics and example count."""

    def log_artifacts(self, files: Mapping[str, str | bytes]) -> None:
        """Files by artifact path: bytes or text content, or a str naming a file or directory (local or fsspec)."""

    def log_datasets(self, manifest: Manifest, name: str) -> None:
        """The manifest's splits as the run's dataset inputs."""

    def log_model(self, saved_model_dir: str, keras_path: str | None, example_input: Manifest | pd.DataFrame, *,
                  storage_options: Mapping[str, Any] | None = None, metrics: Mapping[str, float] | None = None,
                  metric_prefix: str = FINAL_METRIC_PREFIX) -> LoggedModel:
        """The export as the run's model (not registered), with its evaluation linked to it."""

    def record_blessing(self, decision: GateDecision) -> None:
        """The gate's decision on the run's model and why."""

    def record_model_validation(self, validation: ModelValidation) -> None:
        """The model check before registration: passed or not, why, each loader's detail."""

    def record_restart(self, attempt: int, cause: str) -> None:
        """A training restart: its number, its cause and the step it resumed from."""

    def record_resize(self, number: int, story: str, to_workers: int, step: int) -> None:
        """An elastic run's resize `number` (from → to, at step, reason) and its worker count from `step` on."""

    def read_artifact(self, path: str) -> bytes:
        """The content of the run's artifact `path` (a file); raises when the run has none."""

    def record_workers(self, workers: int, step: int) -> None:
        """An elastic run's training workers from `step` on."""

    def set_tags(self, tags: Mapping[str, str]) -> None:
        """Tags on the run (credential-like names dropped)."""

    def ui_url(self) -> str | None:
        """The run's page in the store's UI (a password masked), or None when the store has none."""


class Tracker(Protocol):
    """One tracking store as the pipeline's config names it: its runs, its model registry and the queries the flows
    make."""

    uri: str

    def start_run(self, run_name: str, *, tags: Mapping[str, Any] | None = None) -> TrackedRun:
        """A RUNNING run named `run_name` in the config's experiment (a RUNNING one of that name is reused)."""

    def reopen(self, run_id: str) -> TrackedRun:
        """An existing run set back to RUNNING (a resumed pipeline run goes on logging to it)."""

    def get_run(self, run_id: str) -> TrackedRun:
        """A handle on an existing run, its status unchanged."""

    def metrics_sink(self, run_id: str | None, *, is_chief: bool = True, flush_every: int = 50) -> MetricsSink:
        """The training loop's metrics sink for the run: a null sink without a run or off the chief."""

    def system_metrics(self, run_id: str | None, *, is_chief: bool = True) -> AbstractContextManager[None]:
        """CPU, memory, disk, network (GPU) samples to the run while the block runs, on the chief."""

    def warm_up(self) -> None:
        """Start, in the background, what a later `TrackedRun.log_model` would wait for; return at once. Nothing is
        required of it: logging works without it."""

    def register_model(self, logged: LoggedModel, name: str, *,
                       tags: Mapping[str, Any] | None = None) -> ModelVersionInfo:
        """The logged model as the next version of `name`; a run registers once: when `name` has a version from the
        logged model's run already (a resumed run), that version is returned."""

    def record_decision(self, model_name: str, version: int | str, decision: GateDecision, *,
                        fingerprint: SourceFingerprint | None = None, config_hash: str | None = None,
                        alias: str | None = CHAMPION_ALIAS) -> VersionInfo:
        """The gate's decision on a registered version; a blessed one takes `alias` (None: tag only)."""

    def get_champion(self, model_name: str, alias: str = CHAMPION_ALIAS) -> VersionInfo | None:
        """The version `alias` names, or None."""

    def latest_version(self, model_name: str) -> VersionInfo | None:
        """The newest registered version, or None."""

    def last_refused_run(self, fingerprint: SourceFingerprint, config_hash: str) -> str | None:
        """The newest run on exactly this data and config whose model was not blessed, or None."""

    def download_keras_model(self, model_name: str, version: int | str, dst_dir: str) -> str:
        """A registered version's `.keras` file, downloaded under `dst_dir`."""

    def find_baseline(self, against: str | None = None, exclude_run_id: str | None = None) -> Baseline | None:
        """The schema and statistics data validation compares with (`validation.against`), or None."""

    def start_trial_run(self, parent_run_id: str, study: str, number: int, params: Mapping[str, Any],
                        tags: Mapping[str, str] | None = None) -> TrackedRun:
        """Trial `number`'s run nested under the study's run, its sampled params logged."""

    def find_trial_run(self, parent_run_id: str, number: int) -> str | None:
        """The id of trial `number`'s run under the study's run, or None."""

    def end_stale_trial_runs(self, parent_run_id: str) -> list[str]:
        """End KILLED the trial runs under the study's run still RUNNING; their ids."""

    def end_trial_run(self, run_id: str, *, state: str, value: float | None, metric: str, final_step: int | None,
                      failed: bool) -> None:
        """A trial's outcome (state, value, last step) on its run, and the run ended."""

    def log_study(self, run_id: str, study: optuna.Study, space: Mapping[str, Any], metric: str,
                  best_params: Mapping[str, Any] | None) -> None:
        """The study's summary on its run: space, counts by state, the best trial, history and importances."""


TrackerFactory = Callable[["PipelineConfig"], Tracker]
# Tracking URI scheme → the implementation; a scheme not listed is MLflow's (sqlite, http(s), file, databricks...).
TRACKERS: dict[str, TrackerFactory] = {}


def register_tracker(scheme: str, factory: TrackerFactory) -> None:
    """Make `factory(config)` the tracker of every tracking URI `<scheme>://...`."""
    TRACKERS[scheme.lower()] = factory


def open_tracker(config: PipelineConfig) -> Tracker:
    """The tracker of `config.mlflow_uri`: the one place an implementation is chosen."""
    scheme = config.mlflow_uri.partition("://")[0].lower() if "://" in config.mlflow_uri else ""
    factory = TRACKERS.get(scheme)
    if factory is not None:
        return factory(config)
    from pipeline_lib.tracking.mlflow_backend import MlflowTracker

    return MlflowTracker(config)


def open_recorded_run(tracking_uri: str, run_id: str) -> TrackedRun:
    """A run already in the store at `tracking_uri`, found by its id alone, for reading what it recorded
    (`tfdag reproduce`: the run's config is one of its artifacts). Raises TrackingError when the store has no such
    run."""
    scheme = tracking_uri.partition("://")[0].lower() if "://" in tracking_uri else ""
    if scheme in TRACKERS:
        raise TrackingError(f"reading a recorded run by its store's URI alone is MLflow's; {tracking_uri!r} is a "
                            f"{scheme}:// store: read its runs through open_tracker(config)")
    from pipeline_lib.tracking.mlflow_backend import recorded_run

    return recorded_run(tracking_uri, run_id)
