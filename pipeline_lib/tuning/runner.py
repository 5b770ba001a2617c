"""`run_study`: a config's study run to its budget, `tune.parallel` trials at a time, each an ordinary supervised
training in its own processes and directory; `TrialOutcome` and `StudyResult`, what it reports.

One thread (the caller's) talks to the study: it asks for each trial, builds the trial's config and tells the result.
The trials train on a pool of `tune.parallel` threads, each through the `launch_fn` the caller supplies (the flow
passes the launcher registry's `launch_training` with an MLflow run per trial). Every trial's numbers live in the
study's storage, so a rerun of the same command resumes: finished trials are not run again, a trial left running by
a process that died is marked failed and its budget goes to a new trial.
"""

from __future__ import annotations

import concurrent.futures
import enum
import logging
import math
from collections.abc import Callable
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState
from pydantic import BaseModel, ConfigDict

from pipeline_lib.config import Direction, PipelineConfig, Sampler, TrialBinding
from pipeline_lib.config.tune_space import config_point
from pipeline_lib.core import storage
from pipeline_lib.core.errors import TfdagError, UserError
from pipeline_lib.data.manifest import Manifest
from pipeline_lib.training.results import TrainResult
from pipeline_lib.tuning import space
from pipeline_lib.tuning.study import (
    budget,
    counted,
    open_study,
    recover_stale_trials,
    storage_shown,
    storage_url,
    study_dir,
    study_name,
    tune_of,
    tuned_metric,
)

logger = logging.getLogger(__name__)

LaunchFn = Callable[[PipelineConfig, str, int], TrainResult]  # (trial config, trial run dir, trial number)
# Failures in a row (no trial finished between them) after which the study stops: a space or a setup that fails
# every trial would otherwise start new ones for ever.
MAX_FAILURES_IN_A_ROW = 3
# The user attributes of each trial: what a later run of the study reads back.
PARAMS_ATTR, RUN_DIR_ATTR = "tfdag.params", "tfdag.run_dir"
VALUE_ATTR, BEST_STEP_ATTR = "tfdag.value", "tfdag.best_step"
RESULT_ATTR, ERROR_ATTR = "tfdag.train_result", "tfdag.error"
EVAL_SPLIT = "eval"


class TuningError(TfdagError):
    """The study cannot go on: its trials keep failing. The message names the last errors."""


class TrialStatus(str, enum.Enum):
    COMPLETE = "complete"
    PRUNED = "pruned"
    FAILED = "failed"


class TrialOutcome(BaseModel):
    """One finished trial: its number, how it ended, the values it tried (as the config takes them), its value (the
    best of the tuned metric over its evaluations; None for a failed one), its last step and the step of its value,
    its directory, and its TrainResult or its error."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    number: int
    state: TrialStatus
    params: dict[str, Any]
    value: float | None = None
    final_step: int | None = None
    best_step: int | None = None
    run_dir: str | None = None
    train_result: TrainResult | None = None
    error: str | None = None


class StudyResult(BaseModel):
    """A study after `run_study`: its name and storage (a password masked), the metric and direction, the trials by
    state, the best complete trial (number, params, value, TrainResult, config and directory; None while no trial
    completed) and every finished trial, those of earlier runs of the study included, by number."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    study: str
    storage: str
    metric: str
    direction: Direction
    counts: dict[str, int]
    best_number: int | None = None
    best_params: dict[str, Any] | None = None
    best_value: float | None = None
    best_result: TrainResult | None = None
    best_config: PipelineConfig | None = None
    best_run_dir: str | None = None
    trials: tuple[TrialOutcome, ...] = ()


def trial_run_dir(config: PipelineConfig, number: int) -> str:
    """`<output_root>/tune/<study>/trial-<number>`: where trial `number` trains."""
    return storage.join(study_dir(config), f"trial-{number}")


def trial_config(config: PipelineConfig, params: dict[str, Any], number: int) -> PipelineConfig:
    """The config trial `number` trains with: `params` applied, no `tune` section, `tune_trial` bound to the study.

    Raises:
        ConfigError: naming the values, when they make an invalid config.
    """
    tune = tune_of(config)
    metric, direction = tuned_metric(config)
    binding = TrialBinding(storage=storage_url(config), study=study_name(config), trial_number=number, metric=metric,
                           direction=direction, pruner=tune.pruner, startup_trials=tune.startup_trials)
    return space.apply(config, params, tune_trial=binding)


def run_study(config: PipelineConfig, manifest: Manifest, *, launch: LaunchFn,
              on_trial_finished: Callable[[TrialOutcome], None] | None = None) -> StudyResult:
    """Run `config.tune`'s study until `tune.trials` trials finished (complete or pruned), resuming it if it exists.

    Args:
        config: the pipeline config with its `tune` section.
        manifest: the converted dataset every trial trains on; it needs an eval split (each trial is measured there).
        launch: trains one trial: `launch(trial_config, run_dir, number)` returns the chief's TrainResult (raising
            on failure); called on a pool thread, `tune.parallel` at once.
        on_trial_finished: told each trial this run finishes, in the calling thread, after the study recorded it.

    Returns:
        The StudyResult, with every finished trial of the study.

    Raises:
        ConfigError: no tune section, or a stored study that optimizes another metric.
        UserError: a dataset without an eval split; a trial directory that already holds another study's files.
        TuningError: MAX_FAILURES_IN_A_ROW trials failed with no trial finishing between them.
    """
    tune = tune_of(config)
    if manifest.num_records(EVAL_SPLIT) == 0:
        raise UserError(f"the dataset {manifest.dataset_uri} has no {EVAL_SPLIT} split, on which every trial of "
                        f"study {study_name(config)!r} is measured; give data.split an eval fraction")
    study = open_study(config)
    recover_stale_trials(study)
    if not study.trials and tune.sampler != Sampler.GRID:
        # A new study tries the config as written first, so its best is at least as good as the config's own values
        # on the same budget.
        start = config_point(config, tune.space)
        if start:
            study.enqueue_trial(start)
    total = budget(config)
    metric, _ = tuned_metric(config)
    logger.info("tune | study %s in %s | %s | %d of %d trials done", study.study_name, storage_shown(config), metric,
                counted(study), total)
    failures: list[str] = []
    running: dict[concurrent.futures.Future[TrainResult], tuple[optuna.Trial, dict[str, Any], str]] = {}
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=tune.parallel, thread_name_prefix="tfdag-trial")
    try:
        while True:
            while (len(running) < tune.parallel and counted(study) + len(running) < total
                   and len(failures) < MAX_FAILURES_IN_A_ROW and _grid_left(config, study)):
                trial = study.ask()
                params = space.suggest(trial, tune.space)
                run_dir = trial_run_dir(config, trial.number)
                try:
                    _check_fresh(config, run_dir, trial.number)
                except UserError as error:
                    _tell_failed(study, trial, params, run_dir, error)
                    raise
                try:
                    trial_cfg = trial_config(config, params, trial.number)
                except UserError as error:  # values the config refuses: this trial fails, the next samples anew
                    outcome = _tell_failed(study, trial, params, run_dir, error)
                    failures.append(f"trial {trial.number}: {error}")
                    _finished(outcome, on_trial_finished)
                    continue
                logger.info("tune | trial %d starts | %s", trial.number, _shown_params(params))
                running[pool.submit(launch, trial_cfg, run_dir, trial.number)] = (trial, params, run_dir)
            if not running:
                break
            done, _ = concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED)
            for future in sorted(done, key=lambda f: running[f][0].number):
                trial, params, run_dir = running.pop(future)
                error = future.exception()
                if error is not None:
                    outcome = _tell_failed(study, trial, params, run_dir, error)
                    failures.append(f"trial {trial.number}: {error}")
                else:
                    outcome = _tell_finished(study, trial, params, run_dir, future.result(), config)
                    if outcome.state == TrialStatus.FAILED:
                        failures.append(f"trial {trial.number}: {outcome.error}")
                    else:
                        failures.clear()
                _finished(outcome, on_trial_finished)
    finally:
        # On an error or Ctrl-C here the trials still training are not waited for: they stay RUNNING in the study,
        # and the next run marks them failed (recover_stale_trials).
        pool.shutdown(wait=not running, cancel_futures=True)
    if len(failures) >= MAX_FAILURES_IN_A_ROW:
        raise TuningError(f"study {study.study_name}: {len(failures)} trials failed in a row, so no new one starts; "
                          "fix the cause and run the same command again to resume. The failures:\n  "
                          + "\n  ".join(failures))
    return study_result(config, study)


def study_result(config: PipelineConfig, study: optuna.Study) -> StudyResult:
    """What the study holds now, for `config`: its finished trials, the counts and the best complete trial."""
    tune = tune_of(config)
    metric, direction = tuned_metric(config)
    outcomes = tuple(_outcome_of(t, tune.space) for t in study.get_trials(deepcopy=False)
                     if t.state in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL))
    counts = {status.value: sum(o.state == status for o in outcomes) for status in TrialStatus}
    complete = [o for o in outcomes if o.state == TrialStatus.COMPLETE and o.value is not None]
    best = None
    if complete:
        best = (max if direction == Direction.MAX else min)(complete, key=lambda o: o.value)
    return StudyResult(
        study=study.study_name, storage=storage_shown(config), metric=metric, direction=direction, counts=counts,
        best_number=best.number if best else None, best_params=best.params if best else None,
        best_value=best.value if best else None, best_result=best.train_result if best else None,
        best_config=trial_config(config, best.params, best.number) if best else None,
        best_run_dir=best.run_dir if best else None, trials=outcomes)


def trial_value(trial: FrozenTrial, result: TrainResult, metric: str, direction: Direction
                ) -> tuple[float, int] | None:
    """The trial's value and its step: the best `metric` over its evaluations (those it reported to the study and
    those its kept checkpoints record; the latest step among equals); None when it has no finite one."""
    evaluations = {**{record.step: record.metrics[metric] for record in result.checkpoints if metric in record.metrics},
                   **trial.intermediate_values}
    finite = [(float(value), step) for step, value in evaluations.items() if math.isfinite(value)]
    if not finite:
        return None
    sign = 1.0 if direction == Direction.MAX else -1.0
    return max(finite, key=lambda pair: (sign * pair[0], pair[1]))


def _tell_finished(study: optuna.Study, trial: optuna.Trial, params: dict[str, Any], run_dir: str,
                   result: TrainResult, config: PipelineConfig) -> TrialOutcome:
    metric, direction = tuned_metric(config)
    frozen = next(t for t in study.get_trials(deepcopy=False) if t.number == trial.number)
    best = trial_value(frozen, result, metric, direction)
    value, best_step = best if best is not None else (None, None)
    _record(trial, params, run_dir, value, best_step, result=result)
    if value is None:
        error = (f"trial {trial.number} recorded no {metric} in any evaluation (its checkpoints hold "
                 f"{sorted({m for r in result.checkpoints for m in r.metrics})})")
        trial.set_user_attr(ERROR_ATTR, error)
        study.tell(trial, state=TrialState.FAIL)
        state = TrialStatus.FAILED
    elif result.pruned:
        study.tell(trial, state=TrialState.PRUNED)
        state, error = TrialStatus.PRUNED, None
    else:
        study.tell(trial, value)
        state, error = TrialStatus.COMPLETE, None
    return TrialOutcome(number=trial.number, state=state, params=params, value=value, final_step=result.final_step,
                        best_step=best_step, run_dir=run_dir, train_result=result, error=error)


def _tell_failed(study: optuna.Study, trial: optuna.Trial, params: dict[str, Any], run_dir: str,
                 error: BaseException) -> TrialOutcome:
    text = f"{type(error).__name__}: {error}"
    _record(trial, params, run_dir, None, None, error=text)
    study.tell(trial, state=TrialState.FAIL)
    return TrialOutcome(number=trial.number, state=TrialStatus.FAILED, params=params, run_dir=run_dir, error=text)


def _record(trial: optuna.Trial, params: dict[str, Any], run_dir: str, value: float | None, best_step: int | None,
            *, result: TrainResult | None = None, error: str | None = None) -> None:
    """Keep what a later run of the study reports about this trial in its user attributes (before it is told)."""
    trial.set_user_attr(PARAMS_ATTR, params)
    trial.set_user_attr(RUN_DIR_ATTR, run_dir)
    trial.set_user_attr(VALUE_ATTR, value)
    trial.set_user_attr(BEST_STEP_ATTR, best_step)
    if result is not None:
        trial.set_user_attr(RESULT_ATTR, result.model_dump(mode="json"))
    if error is not None:
        trial.set_user_attr(ERROR_ATTR, error)


def _outcome_of(trial: FrozenTrial, space_: dict[str, Any]) -> TrialOutcome:
    attrs = trial.user_attrs
    result = TrainResult.model_validate(attrs[RESULT_ATTR]) if attrs.get(RESULT_ATTR) else None
    state = {TrialState.COMPLETE: TrialStatus.COMPLETE, TrialState.PRUNED: TrialStatus.PRUNED}.get(
        trial.state, TrialStatus.FAILED)
    value = attrs.get(VALUE_ATTR, trial.value if state == TrialStatus.COMPLETE else None)
    error = attrs.get(ERROR_ATTR)
    if state == TrialStatus.FAILED and error is None:
        error = "the process that ran it ended while it trained (marked failed when the study resumed)"
    return TrialOutcome(
        number=trial.number, state=state, params=attrs.get(PARAMS_ATTR) or space.values_of(trial.params, space_),
        value=value if state != TrialStatus.FAILED else None, final_step=result.final_step if result else None,
        best_step=attrs.get(BEST_STEP_ATTR), run_dir=attrs.get(RUN_DIR_ATTR), train_result=result,
        error=error if state == TrialStatus.FAILED else None)


def _finished(outcome: TrialOutcome, on_trial_finished: Callable[[TrialOutcome], None] | None) -> None:
    shown = f"{outcome.value:.4g}" if outcome.value is not None else "-"
    steps = f"step {outcome.final_step}" if outcome.final_step is not None else outcome.error or ""
    logger.info("tune | trial %d %s | value %s | %s", outcome.number, outcome.state.value, shown, steps)
    if on_trial_finished is not None:
        on_trial_finished(outcome)


def _grid_left(config: PipelineConfig, study: optuna.Study) -> bool:
    """Whether another trial has a point to try: always, except with the grid sampler once every point was handed
    out (finished, failed or running)."""
    tune = tune_of(config)
    return tune.sampler != Sampler.GRID or len(study.get_trials(deepcopy=False)) < tune.grid_size()


def _check_fresh(config: PipelineConfig, run_dir: str, number: int) -> None:
    """A new trial's directory must not exist: one there holds another study's trial (whose checkpoints this trial
    would resume from).

    Raises:
        UserError: naming the directory and the fix.
    """
    fs, path = storage.get_fs(run_dir, config.storage_options)
    if fs.exists(path):
        raise UserError(f"{run_dir} already exists, but trial {number} of study {study_name(config)!r} is new: it "
                        "holds another study's trial (its storage was reset, or another study writes there); remove "
                        "it, or set tune.study to a new name")


def _shown_params(params: dict[str, Any]) -> str:
    return ", ".join(f"{path}={value:.4g}" if isinstance(value, float) else f"{path}={value}"
                     for path, value in params.items())
