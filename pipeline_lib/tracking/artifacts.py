"""The artifacts a finished pipeline run logs to its tracked run: config, data, shard plan, cluster, evaluation,
reproduction record and weights, TensorBoard, task logs, preflight report, restarts."""

from __future__ import annotations

from pipeline_lib.cluster.report import ClusterReport
from pipeline_lib.config import PipelineConfig
from pipeline_lib.core import storage
from pipeline_lib.data.manifest import Manifest
from pipeline_lib.data.statistics import load_statistics
from pipeline_lib.evaluation import slicing
from pipeline_lib.evaluation.consolidation import ExportResult
from pipeline_lib.evaluation.metrics import load_model
from pipeline_lib.evaluation.report import EvalReport
from pipeline_lib.planning import sharding
from pipeline_lib.tracking import reproducibility
from pipeline_lib.tracking.data_check import baseline_artifacts
from pipeline_lib.training.results import TrainResult


def run_artifacts(config: PipelineConfig, manifest: Manifest, plan: sharding.ShardPlan, train_result: TrainResult,
                  export: ExportResult, report: EvalReport, cluster_report: ClusterReport,
                  run_dir: str) -> dict[str, str | bytes]:
    """Every artifact of a finished run by artifact path (see `TrackedRun.log_artifacts` for the values).

    The exported weights (`reproduce/weights.npz`) are read back from the export's `.keras` file: the training
    processes that held them have exited by now.

    Args:
        report: the evaluation with the gate's decision in it (`report.gate`).
    """
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
        failing = report.gate.failing_slices if report.gate is not None else ()
        artifacts["evaluation/slices.json"] = slicing.slices_to_json(report.slices)
        artifacts["evaluation/slices.md"] = slicing.slices_to_markdown(report.slices, failing)
    artifacts.update(preflight_artifacts(run_dir))
    if not config.validation.enabled:  # validate_data logs them otherwise; they make this run a baseline
        statistics = load_statistics(manifest, config.storage_options)
        if statistics is not None:
            artifacts.update(baseline_artifacts(manifest.feature_schema, statistics))
    if train_result.restarts:
        artifacts["training/restarts.txt"] = "".join(f"{r.describe()}\n" for r in train_result.restarts)
    return artifacts


def preflight_artifacts(run_dir: str) -> dict[str, str | bytes]:
    """The cross-worker preflight report (`<run_dir>/preflight/report.{json,md}`) where the chief wrote it."""
    fs, path = storage.get_fs(storage.join(run_dir, "preflight"))
    found: dict[str, str | bytes] = {}
    for name in ("report.json", "report.md"):
        file = storage.join(path, name)
        if fs.exists(file):
            found[f"cluster/preflight_{name}"] = fs.cat_file(file)
    return found
