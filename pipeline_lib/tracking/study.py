"""A tuning study in MLflow: one parent run for the study, one nested run per trial.

The parent run holds the search space, the best trial's params and value, the trial counts by state, and two images:
the optimization history (each finished trial's value and the best so far) and the parameter importances (Optuna's
fANOVA, from two complete trials on). A trial's run is nested under it (`mlflow.parentRunId`): its sampled params as
`tune.<path>`, the metric curves the trial's chief logs while it trains, its state and last step as tags.
"""

from __future__ import annotations

import io
import json
import logging
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from matplotlib.figure import Figure

from pipeline_lib.config import PipelineConfig
from pipeline_lib.tracking import run as tracking
from pipeline_lib.tracking.records import PARENT_TAG, STUDY_TAG, TRIAL_TAG

if TYPE_CHECKING:
    import optuna

logger = logging.getLogger(__name__)

STATE_TAG = "tfdag.tune.state"
PARAM_PREFIX = "tune."
HISTORY_PLOT = "tune/optimization_history.png"
IMPORTANCE_PLOT = "tune/param_importances.png"


def trial_run_name(study: str, number: int) -> str:
    return f"{study}-trial-{number}"


def start_trial_run(config: PipelineConfig, parent_run_id: str, study: str, number: int,
                    params: Mapping[str, Any], tags: Mapping[str, str] | None = None) -> str:
    """The nested MLflow run of trial `number` (a RUNNING run of that name is reused), its params logged."""
    run_id = tracking.start_run(config, trial_run_name(study, number), tags={
        **(tags or {}), PARENT_TAG: parent_run_id, STUDY_TAG: study, TRIAL_TAG: str(number)})
    tracking.log_params(run_id, config.mlflow_uri, {f"{PARAM_PREFIX}{k}": _shown(v) for k, v in params.items()})
    return run_id


def find_trial_run(config: PipelineConfig, parent_run_id: str, number: int) -> str | None:
    """The id of trial `number`'s run under the study's run `parent_run_id` (None: it has none, e.g. its config was
    refused before it trained)."""
    client = tracking.create_client(config.mlflow_uri)
    parent = client.get_run(parent_run_id)
    runs = client.search_runs([parent.info.experiment_id], max_results=1, filter_string=(
        f"tags.`{PARENT_TAG}` = '{parent_run_id}' and tags.`{TRIAL_TAG}` = '{number}' "
        f"and attributes.run_name = '{trial_run_name(parent.data.tags.get(STUDY_TAG, ''), number)}'"))
    return runs[0].info.run_id if runs else None


def end_stale_trial_runs(config: PipelineConfig, parent_run_id: str) -> list[str]:
    """End KILLED the trial runs under `parent_run_id` still RUNNING: left by a study process that died (a resumed
    study starts here; its own trials have not started yet). Returns their ids."""
    client = tracking.create_client(config.mlflow_uri)
    parent = client.get_run(parent_run_id)
    stale = client.search_runs([parent.info.experiment_id], max_results=1000, filter_string=(
        f"tags.`{PARENT_TAG}` = '{parent_run_id}' and attributes.status = 'RUNNING'"))
    for run in stale:
        client.set_tag(run.info.run_id, STATE_TAG, "fail")
        tracking.finish_run(run.info.run_id, config.mlflow_uri, tracking.RunStatus.KILLED)
    return [run.info.run_id for run in stale]


def end_trial_run(config: PipelineConfig, run_id: str, *, state: str, value: float | None, metric: str,
                  final_step: int | None, failed: bool) -> None:
    """Record the trial's outcome (state COMPLETE/PRUNED/FAIL, its value, its last step) and end its run."""
    client = tracking.create_client(config.mlflow_uri)
    client.set_tag(run_id, STATE_TAG, state.lower())
    if final_step is not None:
        client.set_tag(run_id, "tfdag.tune.final_step", str(final_step))
    if value is not None and math.isfinite(value):
        client.log_metric(run_id, f"tune.{metric}", float(value))
    tracking.finish_run(run_id, config.mlflow_uri, tracking.RunStatus.FAILED if failed else
                        tracking.RunStatus.FINISHED)


def log_study(config: PipelineConfig, run_id: str, study: optuna.Study, space: Mapping[str, Any],
              metric: str, best_params: Mapping[str, Any] | None) -> None:
    """The study's summary on its parent run: space, counts by state, best params and value, history and
    importances."""
    import optuna

    counts: dict[str, int] = {}
    for trial in study.trials:
        counts[trial.state.name.lower()] = counts.get(trial.state.name.lower(), 0) + 1
    uri = config.mlflow_uri
    client = tracking.create_client(uri)
    for state in ("complete", "pruned", "fail"):
        client.log_metric(run_id, f"tune.trials_{state}", float(counts.get(state, 0)))
    files: dict[str, str | bytes] = {"tune/space.json": json.dumps(space, indent=2, default=str),
                                     HISTORY_PLOT: history_png(study, metric)}
    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    if complete:
        best = study.best_trial
        tracking.log_params(run_id, uri, {f"best.{k}": _shown(v) for k, v in (best_params or best.params).items()})
        client.log_metric(run_id, f"tune.best_{metric}", float(best.value))
        client.set_tag(run_id, "tfdag.tune.best_trial", str(best.number))
    importances = param_importances(study)
    if importances:
        files[IMPORTANCE_PLOT] = importance_png(importances)
        files["tune/param_importances.json"] = json.dumps(importances, indent=2)
    tracking.log_artifacts(run_id, uri, files)


def param_importances(study: optuna.Study) -> dict[str, float]:
    """Optuna's parameter importances; empty when they cannot be computed (fewer than two complete trials, or
    every trial sampled the same values)."""
    import optuna

    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    if len(complete) < 2:
        return {}
    try:
        return {k: float(v) for k, v in optuna.importance.get_param_importances(study).items()}
    except (RuntimeError, ValueError) as error:
        logger.info("parameter importances not computed: %s", error)
        return {}


def history_png(study: optuna.Study, metric: str) -> bytes:
    """Each finished trial's value by trial number (pruned ones at their last reported value) and the best so far."""
    import optuna

    states = optuna.trial.TrialState
    maximize = study.direction == optuna.study.StudyDirection.MAXIMIZE
    figure = Figure(figsize=(6, 4))
    axes = figure.subplots()
    best: list[tuple[int, float]] = []
    current = None
    for trial in sorted(study.trials, key=lambda t: t.number):
        if trial.state == states.COMPLETE and trial.value is not None:
            axes.scatter([trial.number], [trial.value], color="tab:blue")
            current = trial.value if current is None else (max if maximize else min)(current, trial.value)
            best.append((trial.number, current))
        elif trial.state == states.PRUNED and trial.intermediate_values:
            last = trial.intermediate_values[max(trial.intermediate_values)]
            axes.scatter([trial.number], [last], color="tab:gray", marker="x")
    if best:
        axes.step([n for n, _ in best], [v for _, v in best], where="post", color="tab:red", label="best so far")
        axes.legend()
    axes.set_xlabel("trial")
    axes.set_ylabel(metric)
    axes.set_title(f"{study.study_name}: optimization history (x: pruned)")
    return _png(figure)


def importance_png(importances: Mapping[str, float]) -> bytes:
    figure = Figure(figsize=(6, 0.6 * len(importances) + 1.5))
    axes = figure.subplots()
    names = list(importances)[::-1]
    axes.barh(names, [importances[n] for n in names], color="tab:blue")
    axes.set_xlabel("importance (fANOVA)")
    axes.set_title("parameter importances")
    figure.tight_layout()
    return _png(figure)


def _png(figure: Figure) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=80)
    return buffer.getvalue()


def _shown(value: Any) -> Any:
    """A param value as MLflow shows it: lists as JSON."""
    return json.dumps(value) if isinstance(value, (list, tuple, dict)) else value
