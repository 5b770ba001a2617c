"""The `training-pipeline` flow: convert → plan → validate → train → consolidate → evaluate → log the model → check
it in a fresh process → gate → track (register)."""

from __future__ import annotations

import dataclasses
import importlib.metadata
from typing import Any

from pipeline_lib.core.quiet import import_tensorflow

# A flow-run process (a Prefect worker's) loads TensorFlow here, before anything else does: its start-up lines
# held back unless TFDAG_VERBOSE=1.
import_tensorflow()

from prefect import flow, get_run_logger, runtime
from prefect.states import Completed, State
from pydantic import BaseModel, ConfigDict

from flows.flow_config import DEFAULT_CONFIG, load_flow_config
from pipeline_lib.cluster.report import ClusterReport
from pipeline_lib.config import PipelineConfig
from pipeline_lib.core import runs, storage
from pipeline_lib.data import demo as demo_data
from pipeline_lib.data.manifest import Manifest, dataset_intact
from pipeline_lib.data.validation import ValidationReport
from pipeline_lib.evaluation import plots
from pipeline_lib.evaluation.consolidation import ExportResult, verify_export
from pipeline_lib.evaluation.report import EvalReport, GateDecision
from pipeline_lib.launch import launchers
from pipeline_lib.planning import sharding
from pipeline_lib.serving import fresh_process as model_check
from pipeline_lib.serving.validation import ModelValidation
from pipeline_lib.tracking import lineage
from pipeline_lib.tracking.artifacts import run_artifacts
from pipeline_lib.tracking.params import pipeline_params
from pipeline_lib.tracking.stage_record import (
    StageRecord,
    files_digest,
    find_run_of_flow_run,
    finished_summary,
    model_check_due,
    resume_point,
)
from pipeline_lib.tracking.tracker import LoggedModel, ModelVersionInfo, open_tracker
from pipeline_lib.training import strategy
from pipeline_lib.training.results import TrainResult
from tasks import stages
from tasks.lifecycle import RunLifecycle, tracked_run
from tasks.retrain import evaluate_champion, find_champion

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


def _versions() -> dict[str, str]:
    out = {}
    for dist in ("tensorflow", "keras", "prefect", "mlflow", "tfdag"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "unknown"
    return out


def run_pipeline(config: PipelineConfig, *, extra_tags: dict[str, str] | None = None,
                 resume: str | None = None) -> PipelineSummary:
    """The body of the flow, shared with the retrain flow (which calls it as a subflow).

    With tracking enabled, the MLflow run starts once the storage check passed and always ends: FINISHED on
    success; FAILED when a stage raises, with the stage in the `tfdag.failed_stage` tag; KILLED on Ctrl-C or a
    Prefect cancellation. The supervisor's training restarts all log to this one run. A model the gate did not
    bless ends a FINISHED run tagged `tfdag.blessed=false`; it is registered only with `tracking.register: always`,
    and never when it failed the model check before registration (`tfdag.model_validated=false`).

    `resume` (a run name, or `latest`) continues that run of this pipeline in place (`stage_record.resume_point`):
    the stages it finished are not run again, training goes on from its last verified checkpoint, the same MLflow
    run is reopened. A run that finished returns its summary and does nothing else.
    """
    earlier = resume_point(config, resume) if resume else None
    if earlier is not None:
        finished = finished_summary(earlier[0], earlier[1], PipelineSummary, config.storage_options)
        if finished is not None:
            get_run_logger().info("run %s finished already: nothing to resume", finished.run_name)
            return finished
    with tracked_run(config) as lifecycle:
        summary = _run(config, lifecycle, get_run_logger(), extra_tags or {}, earlier)
    lifecycle.finish(summary)
    return summary


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


def prepare(config: PipelineConfig, progress: RunLifecycle, run_name: str, tags: dict[str, str]) -> Prepared:
    """The stages before training: storage check, the tracked run, conversion, the label's check, data and cluster
    validation."""
    progress.run_name = run_name
    progress("check_storage")
    demo_data.ensure_demo_source(config.data)
    stages.check_storage(config)
    # Started (or, resuming, reopened) before any data is converted, so that a failure in any later stage ends a
    # FAILED run.
    run_id = progress.start_run(run_name, tags).run_id if config.tracking.enabled else None
    launchers.warm_up(config)  # e.g. the local launcher's fork server imports TensorFlow while data converts
    # Resuming, the dataset the run converted, even when the source changed since (a changed source is a new run).
    manifest = progress.once("convert_to_tfrecords", Manifest, lambda: stages.convert_to_tfrecords(config),
                             verify=lambda kept: dataset_intact(kept, config.storage_options),
                             record=lambda m: ({"dataset": m.dataset_uri}, {
                                 "manifest_fingerprint": m.fingerprint, "manifest_content_hash": m.content_hash()}))
    progress("check_label")
    stages.check_label(config, manifest)
    if config.validation.enabled:
        progress.once("validate_data", ValidationReport, lambda: stages.validate_data(config, manifest, run_id))
    progress("validate_cluster")
    cluster_report = stages.validate_cluster(config)
    return Prepared(manifest, cluster_report, run_id)


def _run(config: PipelineConfig, progress: RunLifecycle, logger, extra_tags: dict[str, str],
         earlier: tuple[str, StageRecord] | None) -> PipelineSummary:
    if earlier is None:
        run_name = runs.new_run_name(config.name)
        run_dir, record = runs.run_dir_for(config.output_root, run_name), None
    else:
        (run_dir, record), run_name = earlier, earlier[1].run_name or ""
    progress.begin(run_name, run_dir, record)
    tags = run_tags(run_name, extra_tags)
    prepared = prepare(config, progress, run_name, tags)
    manifest, run_id = prepared.manifest, prepared.run_id
    plan = progress.once("plan_shards", sharding.ShardPlan,
                         lambda: stages.plan_shards(config, manifest, strategy.replicas_per_worker(config.train)))
    # The model check's fresh process imports TensorFlow and MLflow while the run trains (from here, not earlier:
    # a run that stops on its data costs no such process).
    with model_check.warmed(checks_model(config, progress), config.mlflow_uri if run_id else None):
        if logs_model(config, run_id):
            open_tracker(config).warm_up()  # what logging the model waits for, made while the run trains
        # Training that stopped mid-way goes on in the same run directory, from its last verified checkpoint.
        train_result = progress.once("train", TrainResult,
                                     lambda: stages.train(config, manifest, plan, run_dir, run_id),
                                     record=lambda _: ({"run_dir": run_dir}, {}))
        return finish_model(config, progress, prepared, plan, train_result, run_name, run_dir, run_id, tags, logger)


def logs_model(config: PipelineConfig, run_id: str | None) -> bool:
    """Whether the run logs its model to MLflow (`log_model`): it is tracked and names a registered model."""
    return bool(run_id and config.tracking.registered_model)


def checks_model(config: PipelineConfig, progress: RunLifecycle) -> bool:
    """Whether this run's model check is still to come (on, and not finished by an earlier attempt)."""
    return model_check_due(config, progress.earlier)


def finish_model(config: PipelineConfig, progress: RunLifecycle, prepared: Prepared, plan: sharding.ShardPlan,
                 train_result: TrainResult, run_name: str, run_dir: str, run_id: str | None, tags: dict[str, str],
                 logger) -> PipelineSummary:
    """The stages after training, for the model `train_result` left in `run_dir`: consolidation, evaluation, the
    champion, the model's log and check, the gate, tracking (into `run_id`) and registration."""
    manifest, cluster_report = prepared.manifest, prepared.cluster_report
    export = progress.once(
        "consolidate_checkpoints", ExportResult,
        lambda: stages.consolidate_checkpoints(config, manifest, train_result, storage.join(run_dir, "export")),
        verify=lambda kept: not verify_export(kept.export_dir, config.storage_options),
        record=lambda e: ({"export": e.export_dir}, {"export_files": files_digest(e.files),
                                                     "checkpoint_step": str(e.checkpoint_step)}))
    plots_dir = storage.join(run_dir, "evaluation", "plots")
    # Its plots are drawn in the background while the model is logged and checked, and written before track logs them
    # (a kept evaluation whose plots were not written is evaluated again).
    report = progress.once("evaluate", EvalReport,
                           lambda: stages.evaluate(config, manifest, export.keras_path, plots_dir, plots_later=True),
                           verify=lambda kept: plots.all_written(kept.plots, config.storage_options))
    with plots.written_after(plots_dir):
        champion = ChampionResult()
        if config.tracking.enabled and config.tracking.registered_model:
            # The champion of now, unless the gate decided before an earlier attempt stopped.
            gate_decided = progress.earlier is not None and progress.earlier.finished("gate") is not None
            champion = progress.once("evaluate_champion", ChampionResult, lambda: _champion(config, manifest),
                                     verify=lambda _: gate_decided)
        logged = validation = None
        if logs_model(config, run_id):
            # Logged, not registered: track registers it if the gate and the check allow.
            logged = progress.once("log_model", LoggedModel,
                                   lambda: stages.log_model(config, run_id, export, manifest, report.metrics),
                                   record=lambda m: ({"model": m.model_uri}, {}))
        if config.evaluation.validate_model:
            validation = progress.once("validate_model", ModelValidation,
                                       lambda: stages.validate_model(config, manifest, export, logged, run_id))
        decision = progress.once("gate", GateDecision, lambda: stages.gate(
            config, report, champion.report, champion.version, validation))
    report = report.model_copy(update={"gate": decision})

    version = None
    if run_id:
        params = pipeline_params(config, train_result, plan, manifest, _versions())
        artifacts = run_artifacts(config, manifest, plan, train_result, export, report, cluster_report, run_dir)
        version = progress.once(
            "track", ModelVersionInfo | None,
            lambda: stages.track(config, run_id, params, artifacts, report, decision, manifest, tags, logged,
                                 validation),
            record=lambda v: ({"registered_model": v.model_uri} if v else {}, {}))

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
        champion_metrics=champion.report.metrics if champion.report else {},
        stopped_early=train_result.stopped_early,
        stopped_at_step=train_result.stopped_at_step,
        best_step=train_result.best_step,
        stop_reason=train_result.stop_reason,
        baseline_metrics=report.baseline,
        baseline_model=report.baseline_model,
    )


class ChampionResult(BaseModel):
    """The champion the gate compares with: its version and its evaluation on this run's eval split (None: none)."""

    model_config = ConfigDict(frozen=True)

    version: int | None = None
    report: EvalReport | None = None


def _champion(config: PipelineConfig, manifest: Manifest) -> ChampionResult:
    champion = find_champion(config)
    if champion is None:
        return ChampionResult()
    return ChampionResult(version=champion.version, report=evaluate_champion(config, manifest, champion))


def final_state(summary: PipelineSummary) -> PipelineSummary | State:
    """What a pipeline flow returns: the summary, or, when the gate did not bless the model, a Completed state
    named "Not blessed" that carries it (a caller of the flow function still gets the summary)."""
    if summary.blessed:
        return summary
    return Completed(name=NOT_BLESSED_STATE, message=f"trained, not blessed: {summary.gate.reason}", data=summary)


def retried_run(config: PipelineConfig) -> str | None:
    """The run an earlier attempt of this flow run started (Prefect's retry of a terminal flow run re-runs it under the
    same id), to resume; None for a first attempt, or when that attempt stopped before recording a run."""
    if (runtime.flow_run.run_count or 1) <= 1 or not runtime.flow_run.id:
        return None
    found = find_run_of_flow_run(config.output_root, str(runtime.flow_run.id), config.storage_options)
    return found[1].run_name if found is not None else None


@flow(name="training-pipeline", log_prints=True)
def training_pipeline(config: PipelineConfig | str = DEFAULT_CONFIG, resume: str | None = None) -> PipelineSummary:
    """Run the whole training pipeline.

    Args:
        config: the pipeline configuration: a YAML path, inline YAML, or the config itself. Inline YAML (or a
            mapping) is recorded by Prefect as it is, so it must hold no literal secret (see load_flow_config).
        resume: a run name, or `latest`: finish that run of this pipeline in place (`tfdag run --resume`). A
            retry of a flow run resumes the run its earlier attempt started; a new flow run is a new run.

    Returns:
        The PipelineSummary. The flow run ends Completed, named "Not blessed" when the gate did not bless the model.
    """
    loaded = load_flow_config(config)
    resume = resume or retried_run(loaded)
    return final_state(run_pipeline(loaded, resume=resume))  # type: ignore[return-value]  # Prefect unwraps it
