"""One thin Prefect task per pipeline stage: names, retries, artifacts and logging; no logic.

Tasks that touch storage or a server retry, but only transient failures (`tasks.retry.retry_if_transient`): a
config, data or credentials error fails the same way on every attempt and fails at once.

No task caches its result (`cache_policy=NO_CACHE`): Prefect's default key (the flow run and the task's source)
misses on a retried flow run and after a fix. A resumed run skips what already finished by its stage record
(`tasks.lifecycle`), which checks each kept result's digest.
"""

from __future__ import annotations

import json
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import (
    create_link_artifact,
    create_markdown_artifact,
    create_table_artifact,
)
from prefect.cache_policies import NO_CACHE

from pipeline_lib.cluster import check as cluster_check
from pipeline_lib.cluster.report import ClusterReport
from pipeline_lib.config import PipelineConfig
from pipeline_lib.core import events, storage
from pipeline_lib.data import statistics_report
from pipeline_lib.data import validation as data_validation
from pipeline_lib.data.convert import convert
from pipeline_lib.data.manifest import Manifest
from pipeline_lib.data.statistics import load_statistics
from pipeline_lib.data.validation import ValidationReport
from pipeline_lib.evaluation import consolidation
from pipeline_lib.evaluation import metrics as evaluation
from pipeline_lib.evaluation.gate import apply_gate
from pipeline_lib.evaluation.report import EvalReport, GateDecision
from pipeline_lib.launch import launchers as launcher
from pipeline_lib.planning import sharding
from pipeline_lib.serving import rows
from pipeline_lib.serving import validation as model_check
from pipeline_lib.tracking import data_check
from pipeline_lib.tracking.registration import why_not_registered
from pipeline_lib.tracking.tracker import (
    BASELINE_METRIC_PREFIX,
    FINAL_METRIC_PREFIX,
    LoggedModel,
    ModelVersionInfo,
    RunStatus,
    open_tracker,
)
from pipeline_lib.training.results import ResizeRecord, TrainResult
from tasks.progress import ConversionReporter, TrainingReporter
from tasks.progress import artifact_key as _key
from tasks.retry import transient_retries


@task(cache_policy=NO_CACHE, name="check_storage", **transient_retries())
def check_storage(config: PipelineConfig) -> None:
    """Every URI readable/writable with its credentials, before any data is converted or a cluster starts."""
    checked = storage.check_storage(config)
    get_run_logger().info("storage reachable: %s", ", ".join(checked))


@task(cache_policy=NO_CACHE, name="convert_to_tfrecords", **transient_retries())
def convert_to_tfrecords(config: PipelineConfig) -> Manifest:
    """Storage I/O can fail transiently (an object store outage): retried; bad input is not.

    The progress artifact `<pipeline>-conversion-progress` follows the rows converted and the source bytes read."""
    logger = get_run_logger()
    manifest = convert(config.data, config.output_root, config.storage_options,
                       progress_fn=ConversionReporter(config.name), ray=config.train.ray)
    logger.info(
        "TFRecords %s: %d train / %d eval records in %d shards (%d bad records skipped)",
        manifest.dataset_uri,
        manifest.num_records("train"),
        manifest.num_records("eval"),
        len(manifest.shards),
        manifest.num_bad_records,
    )
    return manifest


@task(cache_policy=NO_CACHE, name="check_label", **transient_retries())
def check_label(config: PipelineConfig, manifest: Manifest) -> None:
    """A label with one value in the train split stops the pipeline here, before any training, whatever
    `validation` says (`data.validation.check_label`)."""
    data_validation.check_label(manifest.feature_schema, load_statistics(manifest, config.storage_options),
                                config.model.task)


@task(cache_policy=NO_CACHE, name="validate_data", **transient_retries())
def validate_data(config: PipelineConfig, manifest: Manifest, run_id: str | None) -> ValidationReport:
    """Statistics as artifacts (Prefect and MLflow, where they make this run a later run's baseline), then the
    check against the baseline; an anomaly `validation.allow` does not accept stops the pipeline here."""
    logger = get_run_logger()
    statistics = load_statistics(manifest, config.storage_options)
    files: dict[str, str | bytes] = {}
    if statistics is not None:
        markdown = statistics_report.to_markdown(statistics)
        create_markdown_artifact(markdown, key=_key(f"{config.name}-statistics"), description="Data statistics")
        for split in statistics.splits:
            create_table_artifact(statistics_report.table_rows(statistics, split),
                                  key=_key(f"{config.name}-statistics-{split}"), description=f"Statistics: {split}")
        files.update(data_check.baseline_artifacts(manifest.feature_schema, statistics))
        files["data/statistics.md"] = markdown
        files.update(statistics_report.histogram_artifacts(statistics))
    report = data_check.check_data(config, manifest.feature_schema, statistics, exclude_run_id=run_id)
    create_markdown_artifact(report.to_markdown(), key=_key(f"{config.name}-data-validation"),
                             description=f"Data validation: {len(report.blocking)} blocking anomalies")
    if report.anomalies:
        files["data/anomalies.json"] = report.model_dump_json(indent=2)
        files["data/anomalies.md"] = report.to_markdown()
    if run_id and files:
        open_tracker(config).get_run(run_id).log_artifacts(files)
    for anomaly in report.anomalies:
        (logger.info if anomaly.allowed else logger.error)("data anomaly: %s", anomaly.describe())
    logger.info("data validation against %s: %d anomalies, %d blocking", report.baseline, len(report.anomalies),
                len(report.blocking))
    report.raise_if_blocking()
    return report


@task(cache_policy=NO_CACHE, name="plan_shards")
def plan_shards(config: PipelineConfig, manifest: Manifest, replicas_per_worker: int) -> sharding.ShardPlan:
    plan = sharding.plan_for_train(manifest, config.train, replicas_per_worker)
    logger = get_run_logger()
    for warning in plan.warnings:
        logger.warning(warning)
    create_markdown_artifact(sharding.plan_to_markdown(plan), key=_key(f"{config.name}-shard-plan"),
                             description="Shard plan")
    return plan


@task(cache_policy=NO_CACHE, name="validate_cluster")
def validate_cluster(config: PipelineConfig) -> ClusterReport:
    report = cluster_check.validate_cluster(config)
    create_markdown_artifact(report.to_markdown(), key=_key(f"{config.name}-cluster-report"),
                             description="Cluster environment report")
    return report


@task(cache_policy=NO_CACHE, name="start_tracking_run", **transient_retries())
def start_tracking_run(config: PipelineConfig, run_name: str, tags: dict[str, str]) -> str:
    """The run's tracked run (`Tracker.start_run`): its id."""
    run_id = open_tracker(config).start_run(run_name, tags=tags).run_id
    get_run_logger().info("MLflow run %s in experiment %r at %s", run_id, config.tracking.experiment,
                          config.mlflow_uri_shown)
    return run_id


@task(cache_policy=NO_CACHE, name="reopen_tracking_run", **transient_retries())
def reopen_tracking_run(config: PipelineConfig, run_id: str) -> None:
    """The tracked run of the attempt a resumed run continues, back to RUNNING (`Tracker.reopen`)."""
    open_tracker(config).reopen(run_id)
    get_run_logger().info("MLflow run %s reopened in experiment %r at %s", run_id, config.tracking.experiment,
                          config.mlflow_uri_shown)


@task(cache_policy=NO_CACHE, name="train")
def train(config: PipelineConfig, manifest: Manifest, plan: sharding.ShardPlan, run_dir: str,
          mlflow_run_id: str | None) -> TrainResult:
    """No Prefect retry and no Prefect timeout: the supervisor owns restarts and timeouts of its processes."""
    logger = get_run_logger()
    tracked = open_tracker(config).get_run(mlflow_run_id) if mlflow_run_id else None

    def on_restart(attempt: int, story: str) -> None:
        # Told once the restarted group has restored: the cause and the step it resumed from.
        logger.warning("restart %d of %d: %s", attempt, config.train.max_restarts, story)
        events.emit(events.Restart(attempt, config.train.max_restarts, story))
        if tracked:
            tracked.record_restart(attempt, story)

    def on_resize(resize: ResizeRecord) -> None:
        # An elastic run's resize, told once the resized group has restored.
        logger.warning("%s", resize.describe())
        events.emit(events.Resize(resize.describe()))
        if tracked:
            tracked.record_resize(resize.number, resize.story, resize.to_workers, resize.step or 0)

    if tracked and config.train.elastic is not None:
        tracked.record_workers(config.train.workers, 0)
    reporter = TrainingReporter(config.name, plan.total_steps)
    try:
        result = launcher.launch_training(config, manifest, plan, run_dir, options=launcher.LaunchOptions(
            mlflow_run_id=mlflow_run_id, log_fn=logger.info, on_restart=on_restart, on_progress=reporter,
            on_resize=on_resize))
        reporter.done(result)
        logger.info("training %s at step %d of %d: %s", "stopped early" if result.stopped_early else "ended",
                    result.final_step, result.total_steps, result.stop_reason)
        return result
    finally:
        _preflight_artifact(config, run_dir)


def _preflight_artifact(config: PipelineConfig, run_dir: str) -> None:
    """The cross-worker preflight report (written by the chief, env values masked), pass or fail."""
    fs, path = storage.get_fs(storage.join(run_dir, "preflight", "report.md"), config.storage_options)
    if fs.exists(path):
        create_markdown_artifact(fs.cat_file(path).decode(), key=_key(f"{config.name}-preflight"),
                                 description="Cross-worker preflight")


@task(cache_policy=NO_CACHE, name="consolidate_checkpoints")
def consolidate_checkpoints(config: PipelineConfig, manifest: Manifest, train_result: TrainResult,
                            export_dir: str) -> consolidation.ExportResult:
    export = consolidation.consolidate(config, manifest, train_result, export_dir)
    get_run_logger().info("exported checkpoint step %d (%s) to %s", export.checkpoint_step, export.selected_by,
                          export_dir)
    return export


@task(cache_policy=NO_CACHE, name="evaluate")
def evaluate(config: PipelineConfig, manifest: Manifest, model_path: str, plots_dir: str | None = None,
             plots_later: bool = False) -> EvalReport:
    """Metrics, metrics per slice and the plots (PNG under `plots_dir`) of the exported model on the eval split; with
    `plots_later`, the plots are still drawn when it returns (`evaluation.plots.wait_for` writes them)."""
    report = evaluation.evaluate(config, manifest, model_path, plots_dir=plots_dir, plots_later=plots_later)
    create_markdown_artifact(report.to_markdown(), key=_key(f"{config.name}-evaluation"),
                             description="Evaluation on the eval split")
    create_table_artifact([{"metric": k, "value": round(v, 6),
                            **({"trivial model": round(report.baseline[k], 6)} if k in report.baseline else {})}
                           for k, v in report.metrics.items()],
                          key=_key(f"{config.name}-evaluation-table"), description="Evaluation metrics")
    if report.slices:
        create_table_artifact([{"slice": r.key, "examples": r.num_examples,
                                **{k: round(v, 6) for k, v in r.metrics.items()}} for r in report.slices],
                              key=_key(f"{config.name}-evaluation-slices"), description="Metrics per slice")
    trivial = (f" | trivial model ({report.baseline_model}): "
               f"{json.dumps({k: round(v, 4) for k, v in report.baseline.items()})}" if report.baseline_model else "")
    get_run_logger().info("evaluation: %s%s", json.dumps({k: round(v, 4) for k, v in report.metrics.items()}), trivial)
    return report


@task(cache_policy=NO_CACHE, name="log_model", **transient_retries())
def log_model(config: PipelineConfig, run_id: str, export: consolidation.ExportResult, manifest: Manifest,
              metrics: dict[str, float]) -> LoggedModel:
    """The export logged to the run as an MLflow model (not registered: `track` registers it if it may), with the
    evaluation's metrics linked to it."""
    logged = open_tracker(config).get_run(run_id).log_model(
        export.saved_model_dir, export.keras_path, manifest, storage_options=config.storage_options, metrics=metrics,
        metric_prefix=FINAL_METRIC_PREFIX)
    get_run_logger().info("model logged to MLflow run %s as %s", run_id, logged.model_uri)
    return logged


@task(cache_policy=NO_CACHE, name="validate_model", **transient_retries())
def validate_model(config: PipelineConfig, manifest: Manifest, export: consolidation.ExportResult,
                   logged: LoggedModel | None, run_id: str | None) -> model_check.ModelValidation:
    """The model check before registration (`serving.validation`); its result on the run (`tfdag.model_validated`)
    and as the artifact `<pipeline>-model-validation`. A failed check is a result, not an error: only a storage or
    server outage while reading the rows or the export is retried."""
    why = ("tracking is disabled" if not config.tracking.enabled
           else "no tracking.registered_model: the model is not logged as an MLflow model")
    sample = rows.raw_rows(manifest, model_check.DEFAULT_NUM_ROWS, storage_options=config.storage_options)
    result = model_check.validate_model(
        export.saved_model_dir, export.keras_path, logged.model_uri if logged else None,
        config.mlflow_uri if logged else None, sample, manifest.feature_schema, config.model.task,
        storage_options=config.storage_options, pyfunc_skipped_because=None if logged else why)
    logger = get_run_logger()
    (logger.info if result.passed else logger.warning)("model check: %s", result.reason)
    if run_id:
        open_tracker(config).get_run(run_id).record_model_validation(result)
    verdict = "passed" if result.passed else "failed"
    create_markdown_artifact(result.to_markdown(), key=_key(f"{config.name}-model-validation"),
                             description=f"Model check before registration: {verdict}")
    return result


@task(cache_policy=NO_CACHE, name="gate")
def gate(config: PipelineConfig, report: EvalReport, champion_report: EvalReport | None,
         champion_version: int | None, validation: model_check.ModelValidation | None = None) -> GateDecision:
    """`evaluation.gate`: the threshold, then the margin over the champion on the same eval split; a model that
    failed the model check is not blessed."""
    decision = apply_gate(report, config.evaluation.gate, config.evaluation.effective_min_improvement,
                          champion=champion_report, champion_version=champion_version, validation=validation)
    logger = get_run_logger()
    if decision.blessed:
        logger.info("blessed: %s", decision.reason)
    else:
        logger.warning("not blessed: %s", decision.reason)
    verdict = "blessed" if decision.blessed else "not blessed"
    create_markdown_artifact(f"# `{config.name}`: {verdict}\n\n{decision.reason}\n",
                             key=_key(f"{config.name}-gate"), description=f"Evaluation gate: {verdict}")
    return decision


@task(cache_policy=NO_CACHE, name="track", **transient_retries())
def track(config: PipelineConfig, run_id: str, params: dict[str, Any], artifacts: dict[str, str | bytes],
          eval_report: EvalReport, decision: GateDecision, manifest: Manifest, tags: dict[str, str],
          logged: LoggedModel | None = None,
          validation: model_check.ModelValidation | None = None) -> ModelVersionInfo | None:
    """Params (those the run does not have yet), metrics, artifacts and the blessing on the run; the logged model
    is registered only as `tracking.register` says, never after a failed model check
    (`registration.why_not_registered`), and once per run."""
    tracker = open_tracker(config)
    run = tracker.get_run(run_id)
    logger = get_run_logger()
    run.log_params(params)
    run.log_slice_metrics(eval_report.slices)
    run.log_metrics(eval_report.baseline, prefix=BASELINE_METRIC_PREFIX)
    run.log_datasets(manifest, config.name)
    run.log_artifacts(artifacts)
    run.record_blessing(decision)
    version = None
    name = config.tracking.registered_model
    refused = why_not_registered(config.tracking.register_policy, decision, validation)
    if logged is None:  # no model logged: the final metrics go to the run alone
        run.log_metrics(eval_report.metrics)
    elif refused is not None:
        logger.info("model logged to MLflow run %s, not registered as %s: %s", run_id, name, refused)
    else:
        assert name is not None  # a model is logged only for a registered_model
        version = tracker.register_model(logged, name, tags=tags)
        tracker.record_decision(name, version.version, decision, alias=None)
        logger.info("registered %s version %s (blessed=%s)", version.name, version.version,
                    str(decision.blessed).lower())
    ui = run.ui_url()
    if ui:
        create_link_artifact(ui, link_text="MLflow run", key=_key(f"{config.name}-mlflow-run"))
    return version


@task(cache_policy=NO_CACHE, name="finish_tracking_run", **transient_retries())
def finish_tracking_run(config: PipelineConfig, run_id: str, status: RunStatus,
                        failed_stage: str | None = None) -> None:
    """End the tracked run FINISHED, FAILED or KILLED; a failed run names the stage that raised."""
    open_tracker(config).get_run(run_id).end(status, failed_stage=failed_stage)
    get_run_logger().info("MLflow run %s ended %s%s", run_id, RunStatus(status).value,
                          f" in stage {failed_stage}" if failed_stage else "")
