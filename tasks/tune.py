"""The Prefect task of a tuning study: its trials, each trained by the config's launcher into its own nested MLflow
run, with a table artifact of the trials and a progress artifact updated as each one finishes."""

from __future__ import annotations

import threading
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE

from pipeline_lib.config import PipelineConfig
from pipeline_lib.config.tune_space import value_at
from pipeline_lib.data.manifest import Manifest
from pipeline_lib.launch import launchers as launcher
from pipeline_lib.planning import sharding
from pipeline_lib.tracking.tracker import open_tracker
from pipeline_lib.training import strategy
from pipeline_lib.training.results import TrainResult
from pipeline_lib.tuning import runner
from pipeline_lib.tuning.study import open_study, study_name, tuned_metric
from tasks.progress import ProgressArtifact
from tasks.progress import artifact_key as _key


def trials_artifact_key(config: PipelineConfig) -> str:
    """The key of the study's trial table (each update is a new version of it)."""
    return _key(f"{config.name}-tune-trials")


@task(cache_policy=NO_CACHE, name="run_trials")
def run_trials(config: PipelineConfig, manifest: Manifest, parent_run_id: str | None) -> runner.StudyResult:
    """Run the study to its budget (`runner.run_study`). Each trial trains with the config's launcher (the same
    supervisor, watchdog and restarts as `tfdag run`) into an MLflow run nested under `parent_run_id`; the parent
    run gets the study's summary (`Tracker.log_study`) at the end."""
    logger = get_run_logger()
    assert config.tune is not None
    study = study_name(config)
    metric, _ = tuned_metric(config)
    trial_runs: dict[int, str] = {}
    lock = threading.Lock()
    progress = ProgressArtifact(f"{config.name}-tune-progress", f"tuning: 0 of {config.tune.trials} trials")
    rows: list[dict[str, Any]] = []

    def launch(trial_config: PipelineConfig, run_dir: str, number: int) -> TrainResult:
        run_id = None
        if parent_run_id:
            params = {path: value_at(trial_config, path) for path in config.tune.space}
            run_id = open_tracker(trial_config).start_trial_run(parent_run_id, study, number, params).run_id
            with lock:
                trial_runs[number] = run_id
        plan = sharding.plan_for_train(manifest, trial_config.train, strategy.replicas_per_worker(trial_config.train))

        def log_line(line: str) -> None:
            logger.info("[trial %d] %s", number, line)

        return launcher.launch_training(trial_config, manifest, plan, run_dir, options=launcher.LaunchOptions(
            mlflow_run_id=run_id, log_fn=log_line))

    def finished(outcome: runner.TrialOutcome) -> None:
        with lock:
            run_id = trial_runs.pop(outcome.number, None)
        if run_id is not None:
            tracker.end_trial_run(run_id, state=outcome.state.value, value=outcome.value, metric=metric,
                                  final_step=outcome.final_step, failed=outcome.state == runner.TrialStatus.FAILED)
        rows.append(trial_row(outcome))
        create_table_artifact(sorted(rows, key=lambda r: r["trial"]), key=trials_artifact_key(config),
                              description=f"Study {study}: trials finished by this run")
        done = sum(r["state"] != runner.TrialStatus.FAILED.value for r in rows)
        progress.update(100.0 * done / max(config.tune.trials, 1),
                        f"tuning: {done} trial(s) finished in this run, {config.tune.trials} in the study's budget")

    tracker = open_tracker(config)
    if parent_run_id:
        for run_id in tracker.end_stale_trial_runs(parent_run_id):
            logger.warning("MLflow run %s of a trial an earlier run of the study left running: ended KILLED", run_id)
    result = runner.run_study(config, manifest, launch=launch, on_trial_finished=finished)
    progress.update(100.0, f"tuning: done: {', '.join(f'{v} {k}' for k, v in result.counts.items())}")
    if parent_run_id:
        space = {path: d.model_dump(mode="json", by_alias=True) for path, d in config.tune.space.items()}
        tracker.log_study(parent_run_id, open_study(config), space, metric, result.best_params)
    best = (f"best trial {result.best_number}: {metric}={result.best_value:.4g}" if result.best_number is not None
            else "no trial completed")
    logger.info("study %s: %s | %s", study, ", ".join(f"{v} {k}" for k, v in result.counts.items()), best)
    return result


def trial_row(outcome: runner.TrialOutcome) -> dict[str, Any]:
    """One row of the trial table: number, state, value, steps, params (lists as text)."""
    return {"trial": outcome.number, "state": outcome.state.value,
            "value": round(outcome.value, 6) if outcome.value is not None else None,
            "final_step": outcome.final_step, "best_step": outcome.best_step,
            **{path: str(value) if isinstance(value, (list, tuple, dict)) else value
               for path, value in outcome.params.items()},
            "error": (outcome.error or "")[:200]}
