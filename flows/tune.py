"""The `tune-pipeline` flow: convert and validate once, run the study's trials (`tune.parallel` at a time, each an
ordinary supervised training), then take the best trial's model through consolidation, evaluation, the champion,
the model check, the gate and registration exactly as `training-pipeline` does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline_lib.core.quiet import import_tensorflow

import_tensorflow()  # before anything else loads it: its start-up lines held back unless TFDAG_VERBOSE=1

from prefect import flow, get_run_logger
from prefect.states import Completed, State
from pydantic import BaseModel, ConfigDict, computed_field

from flows.flow_config import load_flow_config
from flows.pipeline import (
    NOT_BLESSED_STATE,
    PipelineSummary,
    checks_model,
    finish_model,
    prepare,
    run_tags,
)
from pipeline_lib.config import PipelineConfig
from pipeline_lib.config.tune_space import tune_of
from pipeline_lib.serving import fresh_process as model_check
from pipeline_lib.tracking.tracker import PARENT_TAG, STUDY_TAG, TRIAL_TAG, open_tracker
from pipeline_lib.training import strategy
from pipeline_lib.tuning.study import study_name
from tasks import stages
from tasks.lifecycle import RunLifecycle, tracked_run
from tasks.tune import run_trials

DEFAULT_TUNE_CONFIG = str(Path(__file__).resolve().parents[1] / "examples" / "digits_tune.yaml")


class BestTrial(BaseModel):
    model_config = ConfigDict(frozen=True)

    number: int
    params: dict[str, Any]
    value: float
    run_dir: str


class TuneSummary(BaseModel):
    """What one tune run returns (and `tfdag tune --json` prints): the study, its trials by state, the best trial,
    and the best model's pipeline summary (evaluation, gate decision, registered version)."""

    model_config = ConfigDict(frozen=True)

    pipeline: str
    study: str
    storage: str  # a password masked
    metric: str
    direction: str
    trials: dict[str, int]  # complete, pruned, failed: every finished trial of the study, earlier runs' included
    mlflow_run_id: str | None  # the study's parent run
    best_trial: BestTrial | None
    model: PipelineSummary | None  # None: no trial completed, nothing to evaluate

    @computed_field  # in the --json line too
    @property
    def blessed(self) -> bool:
        return self.model is not None and self.model.blessed


def run_tune(config: PipelineConfig) -> TuneSummary:
    """The body of the tune flow (see the module docstring); the study's MLflow run ends as `run_pipeline`'s does."""
    tune_of(config)  # a config without a tune: section is refused before any stage
    with tracked_run(config) as lifecycle:
        return _tune(config, lifecycle, get_run_logger())


def _tune(config: PipelineConfig, progress: RunLifecycle, logger) -> TuneSummary:
    study = study_name(config)
    # One parent run per study: a rerun after a crash finds the RUNNING one by name and goes on logging to it.
    run_name = f"{config.name}-{study}-study"
    tags = run_tags(run_name, {STUDY_TAG: study})
    prepared = prepare(config, progress, run_name, tags)
    progress("run_trials")
    result = run_trials(config, prepared.manifest, prepared.run_id)
    summary = {"pipeline": config.name, "study": result.study, "storage": result.storage, "metric": result.metric,
                   "direction": result.direction.value, "trials": result.counts, "mlflow_run_id": prepared.run_id}
    if result.best_number is None or result.best_result is None or result.best_config is None:
        logger.warning("study %s: no trial completed, so there is no model to evaluate", study)
        return TuneSummary(**summary, best_trial=None, model=None)
    assert result.best_run_dir is not None and result.best_value is not None and result.best_params is not None
    best = BestTrial(number=result.best_number, params=result.best_params, value=result.best_value,
                     run_dir=result.best_run_dir)
    best_config = result.best_config
    progress.run_dir = best.run_dir
    progress("plan_shards")
    plan = stages.plan_shards(best_config, prepared.manifest, strategy.replicas_per_worker(best_config.train))
    # The best model's own run, nested under the study's and linked to its trial's run: what the registered version
    # points at. The study's run is the lifecycle's (ended with the flow); this one ends when finish_model does.
    model_run = None
    model_run_name = f"{config.name}-{study}-best-trial-{best.number}"
    if prepared.run_id:
        progress("start_tracking_run")
        trial_run_id = open_tracker(config).find_trial_run(prepared.run_id, best.number)
        model_run_id = stages.start_tracking_run(best_config, model_run_name, {
            **tags, "tfdag_run_name": model_run_name, PARENT_TAG: prepared.run_id,
            TRIAL_TAG: str(best.number), "tfdag.tune.trial_run_id": trial_run_id or ""})
        model_run = open_tracker(best_config).get_run(model_run_id)
    tracking_uri = best_config.mlflow_uri if model_run else None
    with progress.nested_run(model_run), model_check.warmed(checks_model(best_config, progress), tracking_uri):
        model = finish_model(best_config, progress, prepared, plan, result.best_result, model_run_name, best.run_dir,
                             model_run.run_id if model_run else None, tags, logger)
    return TuneSummary(**summary, best_trial=best, model=model)


def final_state(summary: TuneSummary) -> TuneSummary | State:
    """The summary, or a Completed state named "Not blessed" carrying it when the best model was not blessed."""
    if summary.blessed:
        return summary
    reason = summary.model.gate.reason if summary.model is not None else "no trial completed"
    return Completed(name=NOT_BLESSED_STATE, message=f"tuned, not blessed: {reason}", data=summary)


@flow(name="tune-pipeline", log_prints=True)
def tune_pipeline(config: PipelineConfig | str = DEFAULT_TUNE_CONFIG) -> TuneSummary:
    """Tune a pipeline: its `tune:` section's study, then the best trial's model through the gate.

    Args:
        config: a YAML path, inline YAML, or the config itself (inline YAML must hold no literal secret).

    Returns:
        The TuneSummary; the flow run ends Completed, named "Not blessed" when the best model was not blessed.
    """
    return final_state(run_tune(load_flow_config(config)))  # type: ignore[return-value]  # Prefect unwraps it
