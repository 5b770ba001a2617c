"""The `training-pipeline` flow: convert → plan → validate → train → consolidate → evaluate → track."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from prefect import flow, get_run_logger, runtime
from prefect.artifacts import create_markdown_artifact
from pydantic import BaseModel, ConfigDict

from pipeline_lib.config import PipelineConfig, resolve_config
from pipeline_lib.core import runs, storage
from pipeline_lib.data import demo as demo_data
from pipeline_lib.planning import sharding
from pipeline_lib.tracking import mlflow_run as tracking
from pipeline_lib.training import strategy
from tasks import stages

DEFAULT_CONFIG = str(Path(__file__).resolve().parents[1] / "examples" / "digits.yaml")


class PipelineSummary(BaseModel):
    """What one pipeline run returns (and `tfdag run --json` prints)."""

    model_config = ConfigDict(frozen=True)

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
    gate_passed: bool | None


class _Stage:
    """Remembers the running stage so a failure artifact can name it."""

    def __init__(self) -> None:
        self.name = "load_config"

    def __call__(self, name: str) -> None:
        self.name = name


def _versions() -> dict[str, str]:
    out = {}
    for dist in ("tensorflow", "keras", "prefect", "mlflow", "tfdag"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "unknown"
    return out


def run_pipeline(config: PipelineConfig, *, extra_tags: dict[str, str] | None = None) -> PipelineSummary:
    """The body of the flow, shared with the retrain flow (which calls it as a subflow)."""
    stage = _Stage()
    logger = get_run_logger()
    try:
        return _run(config, stage, logger, extra_tags or {})
    except Exception as error:
        create_markdown_artifact(
            f"# Pipeline `{config.name}` failed\n\n**Stage:** `{stage.name}`\n\n**Error:**\n\n```\n{error}\n```\n",
            key=stages._key(f"{config.name}-failure"),
            description=f"failed in stage {stage.name}",
        )
        logger.error("pipeline %r failed in stage %s: %s", config.name, stage.name, error)
        raise


def _run(config: PipelineConfig, stage: _Stage, logger, extra_tags: dict[str, str]) -> PipelineSummary:
    run_name = runs.new_run_name(config.name)
    run_dir = runs.run_dir_for(config.output_root, run_name)
    flow_run_id = str(runtime.flow_run.id or "")
    tags = {"prefect_flow_run_id": flow_run_id, "tfdag_run_name": run_name, **extra_tags}

    stage("check_storage")
    demo_data.ensure_demo_source(config.data)
    stages.check_storage(config)
    stage("convert_to_tfrecords")
    manifest = stages.convert_to_tfrecords(config)
    stage("validate_cluster")
    cluster_report = stages.validate_cluster(config)
    stage("plan_shards")
    plan = stages.plan_shards(config, manifest, strategy.replicas_per_worker(config.train))

    run_id = None
    if config.tracking.enabled:
        stage("start_tracking_run")
        run_id = stages.start_tracking_run(config, run_name, tags)
    stage("train")
    train_result = stages.train(config, manifest, plan, run_dir, run_id)
    stage("consolidate_checkpoints")
    export = stages.consolidate_checkpoints(config, manifest, train_result, storage.join(run_dir, "export"))
    stage("evaluate")
    report = stages.evaluate(config, manifest, export.keras_path)

    version = None
    if run_id:
        stage("track")
        params = tracking.pipeline_params(config, train_result, plan, manifest, _versions())
        artifacts: dict[str, str | bytes] = {
            "data/manifest.json": manifest.to_json(),
            "data/shard_plan.json": plan.model_dump_json(indent=2),
            "data/shard_plan.md": sharding.plan_to_markdown(plan),
            "cluster/cluster_report.json": cluster_report.to_json(),
            "cluster/cluster_report.md": cluster_report.to_markdown(),
            "evaluation/evaluation.json": report.to_json(),
            "evaluation/evaluation.md": report.to_markdown(),
            "tensorboard": train_result.tensorboard_dir,
        }
        artifacts.update(_preflight_artifacts(run_dir))
        version = stages.track(config, run_id, params, artifacts, report, export, manifest, tags)

    gate = report.gate_passed
    logger.info(
        "pipeline %r done: %s | MLflow run %s%s",
        config.name,
        ", ".join(f"{k}={v:.4f}" for k, v in report.metrics.items()),
        run_id,
        f" | model {version.name} v{version.version}" if version else "",
    )
    return PipelineSummary(
        pipeline=config.name,
        run_name=run_name,
        run_dir=run_dir,
        mlflow_run_id=run_id,
        mlflow_uri=config.mlflow_uri,
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
        gate_passed=gate,
    )


def _preflight_artifacts(run_dir: str) -> dict[str, str | bytes]:
    fs, path = storage.get_fs(storage.join(run_dir, "preflight"))
    found: dict[str, str | bytes] = {}
    for name in ("report.json", "report.md"):
        file = storage.join(path, name)
        if fs.exists(file):
            found[f"cluster/preflight_{name}"] = fs.cat_file(file)
    return found


@flow(name="training-pipeline", log_prints=True)
def training_pipeline(config: PipelineConfig | str = DEFAULT_CONFIG) -> PipelineSummary:
    """Run the whole training pipeline.

    Args:
        config: the pipeline configuration: a YAML path, inline YAML, or the config itself.
    """
    return run_pipeline(resolve_config(config))
