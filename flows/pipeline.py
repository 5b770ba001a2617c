"""The `training-pipeline` flow: convert → plan → validate → train → consolidate → evaluate → log the model → check
it in a fresh process → gate → track (register)."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from pipeline_lib.core.quiet import import_tensorflow

# A flow-run process (a Prefect worker's) loads TensorFlow here, before anything else does: its start-up lines
# held back unless TFDAG_VERBOSE=1.
import_tensorflow()

from prefect import flow, get_run_logger, runtime
from prefect.artifacts import create_markdown_artifact
from prefect.exceptions import TerminationSignal
from prefect.states import Completed, State
from pydantic import BaseModel, ConfigDict

from flows.flow_config import load_flow_config
from pipeline_lib.cluster.report import ClusterReport
from pipeline_lib.config import PipelineConfig
from pipeline_lib.core import events, runs, storage
from pipeline_lib.data import demo as demo_data
from pipeline_lib.data.manifest import Manifest
from pipeline_lib.data.statistics import load_statistics
from pipeline_lib.evaluation import slicing
from pipeline_lib.evaluation.metrics import load_model
from pipeline_lib.evaluation.report import GateDecision
from pipeline_lib.launch import launchers
from pipeline_lib.planning import sharding
from pipeline_lib.tracking import lineage, reproducibility
from pipeline_lib.tracking import run as tracking_run
from pipeline_lib.tracking.baseline import baseline_artifacts
from pipeline_lib.tracking.params import pipeline_params
from pipeline_lib.tracking.run import RunStatus
from pipeline_lib.training import strategy
from pipeline_lib.training.results import TrainResult
from tasks import stages
from tasks.retrain import evaluate_champion, find_champion

T = TypeVar("T")
DEFAULT_CONFIG = str(Path(__file__).resolve().parents[1] / "examples" / "digits.yaml")
# The name of the Completed state of a pipeline run whose model the gate did not bless.
NOT_BLESSED_STATE = "Not blessed"


class PipelineSummary(BaseModel):
    """What one pipeline run returns (and `tfdag run --json` prints)."""

    model_config = ConfigDict(frozen=True, protected_namespaces=())  # fields model_name, model_validated

    pipeline: str
    run_name: str
    run_dir: str
    mlflow_run_id: str | None
    mlflow_uri: str
    experiment: str
    metrics: dict[str, float]
    model_name: str | None
    model_version: str | None
    export_dir: str
    data_fingerprint: str
    strategy: str
    num_workers: int
    num_replicas: int
    global_batch_size: int
    scaled_learning_rate: float
    final_step: int
    num_restarts: int
    restarts: list[str]  # each restart: its cause and the step it resumed from
    resizes: list[dict[str, Any]] = []  # an elastic run's resizes: {"from": 3, "to": 2, "step": 1200, "reason": ...}
    blessed: bool
    gate: GateDecision  # why (not) blessed: metric, value, threshold, the champion's value, a failed model check
    model_validated: bool | None = None  # the model check before registration; None: evaluation.validate_model off
    champion_metrics: dict[str, float] = {}  # the champion on the same eval split; empty without a champion
    # How training ended (train.early_stopping): an early stop at `stopped_at_step` (the final step), the best
    # evaluation's step, and why in words; a run that trained its planned steps says so in `stop_reason`.
    stopped_early: bool = False
    stopped_at_step: int | None = None
    best_step: int | None = None
    stop_reason: str = ""
    baseline_metrics: dict[str, float] = {}  # the trivial predictor on the same eval split (`evaluation.trivial`)
    baseline_model: str | None = None  # what it predicts: `train mean 152.1`, `majority class 3 ...`


class _Progress:
    """The running stage and the MLflow run, so that a failure can name the one and end the other; each stage's
    start and end go to the event bus (the `tfdag run` console's checklist)."""

    def __init__(self) -> None:
        self.stage = "load_config"
        self.mlflow_run_id: str | None = None
        self.run_dir: str | None = None
        self._started: float | None = None

    def __call__(self, stage: str) -> None:
        self.end()
        self.stage, self._started = stage, time.monotonic()
        events.emit(events.StageStarted(stage))

    def end(self, *, failed: bool = False) -> None:
        """The running stage ended (failed: it raised); the next `__call__` or nothing follows."""
        if self._started is not None:
            events.emit(events.StageFinished(self.stage, time.monotonic() - self._started, failed=failed))
            self._started = None


def _versions() -> dict[str, str]:
    out = {}
    for dist in ("tensorflow", "keras", "prefect", "mlflow", "tfdag"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "unknown"
    return out


def run_pipeline(config: PipelineConfig, *, extra_tags: dict[str, str] | None = None) -> PipelineSummary:
    """The body of the flow, shared with the retrain flow (which calls it as a subflow).

    With tracking enabled, the MLflow run starts once the storage check passed and always ends: FINISHED on
    success; FAILED when a stage raises, with the stage in the `tfdag.failed_stage` tag; KILLED on Ctrl-C or a
    Prefect cancellation. The supervisor's training restarts all log to this one run. A model the gate did not
    bless ends a FINISHED run tagged `tfdag.blessed=false`; it is registered only with `tracking.register: always`,
    and never when it failed the model check before registration (`tfdag.model_validated=false`).
    """
    return run_tracked(config, lambda progress, logger: _run(config, progress, logger, extra_tags or {}))


def run_tracked(config: PipelineConfig, body: Callable[[_Progress, Any], T]) -> T:
    """Run a flow's `body(progress, logger)` and end the MLflow run it started (`progress.mlflow_run_id`) as
    `run_pipeline` says: FINISHED, FAILED with the failed stage, or KILLED; a failure also leaves a Prefect
    artifact naming the stage and the training tasks' logs in MLflow."""
    progress = _Progress()
    logger = get_run_logger()
    try:
        result = body(progress, logger)
        progress("finish_tracking_run")
        end_tracking_run(config, progress.mlflow_run_id, RunStatus.FINISHED)
        progress.end()
        return result
    except (KeyboardInterrupt, TerminationSignal):
        progress.end(failed=True)
        logger.error("pipeline %r stopped in stage %s", config.name, progress.stage)
        keep_task_logs(config, progress)
        end_tracking_run(config, progress.mlflow_run_id, RunStatus.KILLED, progress.stage)
        raise
    except Exception as error:
        progress.end(failed=True)
        create_markdown_artifact(
            f"# Pipeline `{config.name}` failed\n\n**Stage:** `{progress.stage}`\n\n**Error:**\n\n```\n{error}\n```\n",
            key=stages._key(f"{config.name}-failure"),
            description=f"failed in stage {progress.stage}",
        )
        logger.error("pipeline %r failed in stage %s: %s", config.name, progress.stage, error)
        keep_task_logs(config, progress)
        end_tracking_run(config, progress.mlflow_run_id, RunStatus.FAILED, progress.stage)
        raise


def keep_task_logs(config: PipelineConfig, progress: _Progress) -> None:
    """On a failed or stopped run, the training tasks' logs (`<run_dir>/logs/`) go to MLflow as artifacts `logs/`,
    so a failed worker's traceback survives its process. Best effort: the error that stopped the run is the one to
    report."""
    if progress.mlflow_run_id is None or progress.run_dir is None:
        return
    logs = storage.join(progress.run_dir, "logs")
    try:
        fs, path = storage.get_fs(logs, config.storage_options)
        if fs.exists(path):
            tracking_run.log_artifacts(progress.mlflow_run_id, config.mlflow_uri, {"logs": logs})
    except Exception as error:  # noqa: BLE001 - see the docstring
        get_run_logger().warning("task logs not logged to MLflow run %s: %s", progress.mlflow_run_id, error)


def end_tracking_run(config: PipelineConfig, run_id: str | None, status: RunStatus,
                     failed_stage: str | None = None) -> None:
    """End the MLflow run (when there is one) with `status`.

    A run that ends FAILED or KILLED records `failed_stage`. On those paths an error while ending the run is
    logged, not raised: the error that stopped the pipeline is the one to report.
    """
    if run_id is None:
        return
    if status == RunStatus.FINISHED:
        stages.finish_tracking_run(config, run_id, status)
        return
    try:
        stages.finish_tracking_run(config, run_id, status, failed_stage)
    except Exception as error:  # noqa: BLE001 - see the docstring
        get_run_logger().warning("MLflow run %s could not be ended %s: %s", run_id, status.value, error)


@dataclasses.dataclass(frozen=True)
class Prepared:
    """What every training run of a flow shares, made once: the converted data, the cluster report, and the MLflow
    run the data's statistics went to (None without tracking)."""

    manifest: Manifest
    cluster_report: ClusterReport
    run_id: str | None


def run_tags(run_name: str, extra_tags: dict[str, str]) -> dict[str, str]:
    """The tags of a flow's MLflow run: the Prefect flow run, the run name, where the code came from."""
    return {"prefect_flow_run_id": str(runtime.flow_run.id or ""), "tfdag_run_name": run_name,
            **lineage.source_tags(runtime.flow_run.flow_name, runtime.deployment.name, lineage.git_commit()),
            **extra_tags}


def prepare(config: PipelineConfig, progress: _Progress, run_name: str, tags: dict[str, str]) -> Prepared:
    """The stages before training: storage check, the MLflow run, conversion, the label's check, data and cluster
    validation."""
    progress("check_storage")
    demo_data.ensure_demo_source(config.data)
    stages.check_storage(config)
    run_id = None
    if config.tracking.enabled:
        # Started before any data is converted, so that a failure in any later stage ends a FAILED run.
        progress("start_tracking_run")
        run_id = progress.mlflow_run_id = stages.start_tracking_run(config, run_name, tags)
    launchers.warm_up(config)  # e.g. the local launcher's fork server imports TensorFlow while data converts
    progress("convert_to_tfrecords")
    manifest = stages.convert_to_tfrecords(config)
    progress("check_label")
    stages.check_label(config, manifest)
    if config.validation.enabled:
        progress("validate_data")
        stages.validate_data(config, manifest, run_id)
    progress("validate_cluster")
    cluster_report = stages.validate_cluster(config)
    return Prepared(manifest, cluster_report, run_id)


def _run(config: PipelineConfig, progress: _Progress, logger, extra_tags: dict[str, str]) -> PipelineSummary:
    run_name = runs.new_run_name(config.name)
    run_dir = progress.run_dir = runs.run_dir_for(config.output_root, run_name)
    tags = run_tags(run_name, extra_tags)
    prepared = prepare(config, progress, run_name, tags)
    manifest, run_id = prepared.manifest, prepared.run_id
    progress("plan_shards")
    plan = stages.plan_shards(config, manifest, strategy.replicas_per_worker(config.train))
    progress("train")
    train_result = stages.train(config, manifest, plan, run_dir, run_id)
    return finish_model(config, progress, prepared, plan, train_result, run_name, run_dir, run_id, tags, logger)


def finish_model(config: PipelineConfig, progress: _Progress, prepared: Prepared, plan: sharding.ShardPlan,
                 train_result: TrainResult, run_name: str, run_dir: str, run_id: str | None, tags: dict[str, str],
                 logger) -> PipelineSummary:
    """The stages after training, for the model `train_result` left in `run_dir`: consolidation, evaluation, the
    champion, the model's log and check, the gate, tracking (into `run_id`) and registration."""
    manifest, cluster_report = prepared.manifest, prepared.cluster_report
    progress("consolidate_checkpoints")
    export = stages.consolidate_checkpoints(config, manifest, train_result, storage.join(run_dir, "export"))
    progress("evaluate")
    report = stages.evaluate(config, manifest, export.keras_path, storage.join(run_dir, "evaluation", "plots"))
    champion = champion_report = None
    if config.tracking.enabled and config.tracking.registered_model:
        progress("evaluate_champion")
        champion = find_champion(config)
        if champion is not None:
            champion_report = evaluate_champion(config, manifest, champion)
    logged = validation = None
    if run_id and config.tracking.registered_model:
        progress("log_model")  # logged, not registered: track registers it if the gate and the check allow
        logged = stages.log_model(config, run_id, export, manifest, report.metrics)
    if config.evaluation.validate_model:
        progress("validate_model")
        validation = stages.validate_model(config, manifest, export, logged, run_id)
    progress("gate")
    decision = stages.gate(config, report, champion_report, champion.version if champion else None, validation)
    report = report.model_copy(update={"gate": decision})

    version = None
    if run_id:
        progress("track")
        params = pipeline_params(config, train_result, plan, manifest, _versions())
        record = reproducibility.build_record(config, train_result, plan, manifest, export.checkpoint_step,
                                              export.selected_by)
        exported_weights = reproducibility.model_weights(load_model(export.keras_path, config.storage_options))
        artifacts: dict[str, str | bytes] = {
            reproducibility.CONFIG_ARTIFACT: config.masked_yaml(),
            reproducibility.MANIFEST_ARTIFACT: manifest.to_json(),
            reproducibility.SHARD_PLAN_ARTIFACT: plan.model_dump_json(indent=2),
            **reproducibility.reproduction_artifacts(record, exported_weights),
            "data/shard_plan.md": sharding.plan_to_markdown(plan),
            "cluster/cluster_report.json": cluster_report.to_json(),
            "cluster/cluster_report.md": cluster_report.to_markdown(),
            "evaluation/evaluation.json": report.to_json(),
            "evaluation/evaluation.md": report.to_markdown(),
            **{f"evaluation/plots/{name}.png": uri for name, uri in report.plots.items()},
            "tensorboard": train_result.tensorboard_dir,
            "logs": storage.join(run_dir, "logs"),
        }
        if report.slices:
            artifacts["evaluation/slices.json"] = slicing.slices_to_json(report.slices)
            artifacts["evaluation/slices.md"] = slicing.slices_to_markdown(report.slices, decision.failing_slices)
        artifacts.update(_preflight_artifacts(run_dir))
        if not config.validation.enabled:  # validate_data logs them otherwise; they make this run a baseline
            statistics = load_statistics(manifest, config.storage_options)
            if statistics is not None:
                artifacts.update(baseline_artifacts(manifest.feature_schema, statistics))
        if train_result.restarts:
            artifacts["training/restarts.txt"] = "".join(f"{r.describe()}\n" for r in train_result.restarts)
        version = stages.track(config, run_id, params, artifacts, report, decision, manifest, tags, logged, validation)

    logger.info(
        "pipeline %r done: %s | blessed: %s | MLflow run %s%s",
        config.name,
        ", ".join(f"{k}={v:.4f}" for k, v in report.metrics.items()),
        str(decision.blessed).lower(),
        run_id,
        f" | model {version.name} v{version.version}" if version else "",
    )
    return PipelineSummary(
        pipeline=config.name,
        run_name=run_name,
        run_dir=run_dir,
        mlflow_run_id=run_id,
        mlflow_uri=config.mlflow_uri_shown,  # a password masked: the summary is printed and stored
        experiment=config.tracking.experiment,
        metrics=report.metrics,
        model_name=version.name if version else None,
        model_version=str(version.version) if version else None,
        export_dir=storage.join(run_dir, "export"),
        data_fingerprint=manifest.fingerprint,
        strategy=train_result.strategy,
        num_workers=train_result.num_workers,
        num_replicas=train_result.num_replicas,
        global_batch_size=train_result.global_batch_size,
        scaled_learning_rate=train_result.scaled_learning_rate,
        final_step=train_result.final_step,
        num_restarts=train_result.num_restarts,
        restarts=[r.describe() for r in train_result.restarts],
        resizes=[r.summary() for r in train_result.resizes],
        blessed=decision.blessed,
        gate=decision,
        model_validated=validation.passed if validation else None,
        champion_metrics=champion_report.metrics if champion_report else {},
        stopped_early=train_result.stopped_early,
        stopped_at_step=train_result.stopped_at_step,
        best_step=train_result.best_step,
        stop_reason=train_result.stop_reason,
        baseline_metrics=report.baseline,
        baseline_model=report.baseline_model,
    )


def _preflight_artifacts(run_dir: str) -> dict[str, str | bytes]:
    fs, path = storage.get_fs(storage.join(run_dir, "preflight"))
    found: dict[str, str | bytes] = {}
    for name in ("report.json", "report.md"):
        file = storage.join(path, name)
        if fs.exists(file):
            found[f"cluster/preflight_{name}"] = fs.cat_file(file)
    return found


def final_state(summary: PipelineSummary) -> PipelineSummary | State:
    """What a pipeline flow returns: the summary, or, when the gate did not bless the model, a Completed state
    named "Not blessed" that carries it (a caller of the flow function still gets the summary)."""
    if summary.blessed:
        return summary
    return Completed(name=NOT_BLESSED_STATE, message=f"trained, not blessed: {summary.gate.reason}", data=summary)


@flow(name="training-pipeline", log_prints=True)
def training_pipeline(config: PipelineConfig | str = DEFAULT_CONFIG) -> PipelineSummary:
    """Run the whole training pipeline.

    Args:
        config: the pipeline configuration: a YAML path, inline YAML, or the config itself. Inline YAML (or a
            mapping) is recorded by Prefect as it is, so it must hold no literal secret (see load_flow_config).

    Returns:
        The PipelineSummary. The flow run ends Completed, named "Not blessed" when the gate did not bless the model.
    """
    return final_state(run_pipeline(load_flow_config(config)))  # type: ignore[return-value]  # Prefect unwraps it
