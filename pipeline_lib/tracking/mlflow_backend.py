"""The MLflow implementation of the tracking interface (`tracking.tracker`): `MlflowTracker` and its `MlflowRun`.

The MLflow calls themselves live in this package's helper modules (`run`, `model_logging`, `registry`, `lineage`,
`baseline`, `study`, `sinks`); these two classes are the only way the rest of tfdag reaches them.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pipeline_lib.config import PipelineConfig
from pipeline_lib.core.secrets import mask_url_passwords
from pipeline_lib.tracking import (
    baseline,
    lineage,
    model_logging,
    registry,
    sinks,
    study,
)
from pipeline_lib.tracking import run as mlflow_run
from pipeline_lib.tracking.client import bound_http_retries, clean_tags, create_client
from pipeline_lib.tracking.records import (
    CHAMPION_ALIAS,
    FINAL_METRIC_PREFIX,
    RunStatus,
    TrackingError,
    TrackingUnreachable,
)

if TYPE_CHECKING:
    import optuna
    import pandas as pd

    from pipeline_lib.data.manifest import Manifest, SourceFingerprint
    from pipeline_lib.evaluation.report import GateDecision
    from pipeline_lib.evaluation.slicing import SliceResult
    from pipeline_lib.serving.validation import ModelValidation
    from pipeline_lib.training.hooks import MetricsSink

logger = logging.getLogger(__name__)


def _unreachable_reason(error: BaseException) -> str | None:
    """Why an MLflow server did not answer, when that is what `error` says (else None)."""
    text = str(error)
    if "Max retries exceeded" not in text and "failed with exception" not in text and not isinstance(
            error, (ConnectionError, TimeoutError)):
        return None
    if "refused" in text.lower():
        return "connection refused"
    if "timed out" in text.lower() or "timeout" in text.lower():
        return "no answer in time"
    return "no answer"


@contextlib.contextmanager
def _answering(uri: str, what: str, *, mid_run: bool = False) -> Iterator[None]:
    """Turn an MLflow server at `uri` that does not answer during `what` into one line: a TrackingError when it
    never answered, a TrackingUnreachable (transient) when it stopped answering mid-run."""
    try:
        yield
    except (TrackingError, TrackingUnreachable):
        raise
    except Exception as error:
        reason = _unreachable_reason(error)
        if reason is None or not uri.startswith(("http://", "https://")):
            raise
        shown = mask_url_passwords(uri)
        if mid_run:  # it answered before: an outage, which a task retries, then a resume finishes the run
            raise TrackingUnreachable(
                f"MLflow tracking server {shown} did not answer ({reason}) when {what}; "
                "once it answers again, finish the run where it stopped with `tfdag run CONFIG --resume`"
            ) from None
        raise TrackingError(
            f"MLflow tracking server {shown} did not answer ({reason}) when {what}; "
            "start it (tfdag stack up) or point tracking.mlflow_uri (or MLFLOW_TRACKING_URI) at a running "
            "server, or set tracking.enabled: false") from None


def _answered(what: str):
    """A run's call that, when the server stops answering, raises TrackingUnreachable saying `what` it was doing."""
    def wrap(method):
        @functools.wraps(method)
        def call(self: MlflowRun, *args: Any, **kwargs: Any) -> Any:
            with _answering(self._uri, f"{what} (run {self.run_id})", mid_run=True):
                return method(self, *args, **kwargs)
        return call
    return wrap


class MlflowRun:
    """One MLflow run of the tracker's store (see `tracking.tracker.TrackedRun`). A server that stops answering
    during a call is a TrackingUnreachable naming the server and what the call was doing."""

    def __init__(self, tracker: MlflowTracker, run_id: str):
        self.tracker = tracker
        self.run_id = run_id

    def __repr__(self) -> str:
        return f"MlflowRun({self.run_id!r}, {mask_url_passwords(self._uri)!r})"

    @property
    def _uri(self) -> str:
        return self.tracker.uri

    @_answered("ending the run")
    def end(self, status: RunStatus | str = RunStatus.FINISHED, *, failed_stage: str | None = None) -> None:
        mlflow_run.finish_run(self.run_id, self._uri, status, failed_stage=failed_stage)

    @_answered("reading an artifact")
    def read_artifact(self, path: str) -> bytes:
        return mlflow_run.read_artifact(self.run_id, self._uri, path)

    @_answered("logging params")
    def log_params(self, params: Mapping[str, Any]) -> None:
        mlflow_run.log_params(self.run_id, self._uri, params)

    @_answered("logging metrics")
    def log_metrics(self, metrics: Mapping[str, float], *, prefix: str = FINAL_METRIC_PREFIX, step: int = 0) -> None:
        mlflow_run.log_final_metrics(self.run_id, self._uri, metrics, step=step, prefix=prefix)

    @_answered("logging slice metrics")
    def log_slice_metrics(self, slices: Sequence[SliceResult]) -> None:
        mlflow_run.log_slice_metrics(self.run_id, self._uri, slices)

    @_answered("logging artifacts")
    def log_artifacts(self, files: Mapping[str, str | bytes]) -> None:
        mlflow_run.log_artifacts(self.run_id, self._uri, files)

    @_answered("logging datasets")
    def log_datasets(self, manifest: Manifest, name: str) -> None:
        lineage.log_datasets(self.run_id, self._uri, manifest, name)

    @_answered("logging the model")
    def log_model(self, saved_model_dir: str, keras_path: str | None, example_input: Manifest | pd.DataFrame, *,
                  storage_options: Mapping[str, Any] | None = None, metrics: Mapping[str, float] | None = None,
                  metric_prefix: str = FINAL_METRIC_PREFIX) -> model_logging.LoggedModel:
        return model_logging.log_model(self.run_id, self._uri, saved_model_dir, keras_path, example_input,
                                       storage_options=storage_options, metrics=metrics, metric_prefix=metric_prefix)

    @_answered("recording the blessing")
    def record_blessing(self, decision: GateDecision) -> None:
        mlflow_run.record_blessing(self.run_id, self._uri, decision)

    @_answered("recording the model check")
    def record_model_validation(self, validation: ModelValidation) -> None:
        mlflow_run.record_model_validation(self.run_id, self._uri, validation)

    @_answered("recording a restart")
    def record_restart(self, attempt: int, cause: str) -> None:
        mlflow_run.record_restart(self.run_id, self._uri, attempt, cause)

    @_answered("recording a resize")
    def record_resize(self, number: int, story: str, to_workers: int, step: int) -> None:
        mlflow_run.record_resize(self.run_id, self._uri, number, story, to_workers, step)

    @_answered("recording the workers")
    def record_workers(self, workers: int, step: int) -> None:
        mlflow_run.record_workers(self.run_id, self._uri, workers, step)

    @_answered("setting tags")
    def set_tags(self, tags: Mapping[str, str]) -> None:
        client = create_client(self._uri)
        for name, value in clean_tags(tags).items():
            client.set_tag(self.run_id, name, value)

    def ui_url(self) -> str | None:
        return mlflow_run.run_ui_url(self._uri, self.run_id)


class MlflowTracker:
    """The MLflow store of a pipeline config (`config.mlflow_uri`): its experiment's runs and its model registry
    (see `tracking.tracker.Tracker`).

    HTTP retries are bounded (`client.HTTP_DEFAULTS`), and a server that does not answer when a run starts is one
    TrackingError naming the (masked) URI and the fix.
    """

    def __init__(self, config: PipelineConfig):
        self.config = config
        self.uri = config.mlflow_uri
        if self.uri.startswith(("http://", "https://")):
            bound_http_retries()

    def _answering(self, what: str, *, mid_run: bool = False) -> contextlib.AbstractContextManager[None]:
        return _answering(self.uri, what, mid_run=mid_run)

    def start_run(self, run_name: str, *, tags: Mapping[str, Any] | None = None) -> MlflowRun:
        with self._answering(f"starting run {run_name!r}"):
            return MlflowRun(self, mlflow_run.start_run(self.config, run_name, tags=tags))

    def reopen(self, run_id: str) -> MlflowRun:
        with self._answering(f"reopening run {run_id}"):
            mlflow_run.reopen_run(run_id, self.uri)
        return MlflowRun(self, run_id)

    def get_run(self, run_id: str) -> MlflowRun:
        return MlflowRun(self, run_id)

    def metrics_sink(self, run_id: str | None, *, is_chief: bool = True, flush_every: int = 50) -> MetricsSink:
        return sinks.create_sink(run_id, self.uri, is_chief=is_chief, flush_every=flush_every)

    def system_metrics(self, run_id: str | None, *, is_chief: bool = True) -> contextlib.AbstractContextManager[None]:
        return sinks.system_metrics(run_id, self.uri, is_chief=is_chief)

    def warm_up(self) -> None:
        model_logging.warm_up()  # MLflow's map of installed packages, which logging a model checks first

    def register_model(self, logged: model_logging.LoggedModel, name: str, *,
                       tags: Mapping[str, Any] | None = None) -> model_logging.ModelVersionInfo:
        return model_logging.register_model(self.uri, logged, name, tags=tags)

    def record_decision(self, model_name: str, version: int | str, decision: GateDecision, *,
                        fingerprint: SourceFingerprint | None = None, config_hash: str | None = None,
                        alias: str | None = CHAMPION_ALIAS) -> registry.VersionInfo:
        return registry.record_decision(self.uri, model_name, version, decision, fingerprint=fingerprint,
                                        config_hash=config_hash, alias=alias)

    def get_champion(self, model_name: str, alias: str = CHAMPION_ALIAS) -> registry.VersionInfo | None:
        with self._answering(f"looking up the {alias} of {model_name!r}"):
            return registry.get_champion(self.uri, model_name, alias)

    def latest_version(self, model_name: str) -> registry.VersionInfo | None:
        return registry.latest_version(self.uri, model_name)

    def last_refused_run(self, fingerprint: SourceFingerprint, config_hash: str) -> str | None:
        return registry.last_refused_run(self.uri, self.config.tracking.experiment, fingerprint, config_hash)

    def download_keras_model(self, model_name: str, version: int | str, dst_dir: str) -> str:
        return registry.download_keras_model(self.uri, model_name, version, dst_dir)

    def find_baseline(self, against: str | None = None,
                      exclude_run_id: str | None = None) -> baseline.Baseline | None:
        with self._answering("looking up the data validation baseline"):
            return baseline.find_baseline(self.config, against, exclude_run_id)

    def start_trial_run(self, parent_run_id: str, study_name: str, number: int, params: Mapping[str, Any],
                        tags: Mapping[str, str] | None = None) -> MlflowRun:
        return MlflowRun(self, study.start_trial_run(self.config, parent_run_id, study_name, number, params, tags))

    def find_trial_run(self, parent_run_id: str, number: int) -> str | None:
        return study.find_trial_run(self.config, parent_run_id, number)

    def end_stale_trial_runs(self, parent_run_id: str) -> list[str]:
        return study.end_stale_trial_runs(self.config, parent_run_id)

    def end_trial_run(self, run_id: str, *, state: str, value: float | None, metric: str, final_step: int | None,
                      failed: bool) -> None:
        study.end_trial_run(self.config, run_id, state=state, value=value, metric=metric, final_step=final_step,
                            failed=failed)

    def log_study(self, run_id: str, optuna_study: optuna.Study, space: Mapping[str, Any], metric: str,
                  best_params: Mapping[str, Any] | None) -> None:
        study.log_study(self.config, run_id, optuna_study, space, metric, best_params)


class _RecordedStore:
    """The store of a run found by its URI alone, with no pipeline config: all an `MlflowRun` reads of its tracker."""

    def __init__(self, uri: str):
        self.uri = uri


def recorded_run(tracking_uri: str, run_id: str) -> MlflowRun:
    """Run `run_id` of the MLflow store at `tracking_uri` (see `tracker.open_recorded_run`)."""
    try:
        create_client(tracking_uri).get_run(run_id)
    except Exception as error:
        raise TrackingError(f"MLflow run {run_id!r} was not found at {mask_url_passwords(tracking_uri)} ({error}); "
                            "pass the run id from the MLflow UI and the store it lives in (--tracking-uri)") from error
    return MlflowRun(_RecordedStore(tracking_uri), run_id)  # type: ignore[arg-type]  # only .uri is read
