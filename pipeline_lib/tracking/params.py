"""The MLflow params of a pipeline run, built from its typed config and results."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pipeline_lib.config import PipelineConfig
from pipeline_lib.data.manifest import Manifest
from pipeline_lib.planning.sharding import ShardPlan
from pipeline_lib.training.results import TrainResult


def pipeline_params(config: PipelineConfig, train_result: TrainResult, plan: ShardPlan,
                    manifest: Manifest, versions: Mapping[str, str]) -> dict[str, Any]:
    """The params of a pipeline run, built from typed fields only, so no storage option or env value gets in.

    Args:
        config: the pipeline config.
        train_result: the chief's TrainResult (the strategy and batch sizes actually used).
        plan: the shard plan.
        manifest: the dataset manifest.
        versions: package versions, e.g. {"tensorflow": "2.21.0"} (a `_version` suffix is added when missing).

    Returns:
        A flat {name: value} mapping for `log_params`.
    """
    train = config.train
    files = {path for assignment in plan.assignments for path in assignment.files}
    num_files = len(files) or len(manifest.shards_for("train"))
    params: dict[str, Any] = {
        "pipeline": config.name,
        "strategy": train_result.strategy,
        "strategy_reason": train_result.strategy_reason,
        "num_workers": train_result.num_workers,
        "num_replicas": train_result.num_replicas,
        "per_replica_batch_size": train_result.per_replica_batch_size,
        "global_batch_size": train_result.global_batch_size,
        "base_learning_rate": train_result.base_learning_rate,
        "scaled_learning_rate": train_result.scaled_learning_rate,
        "lr_scaling": train_result.lr_scaling,
        "warmup_steps": train.warmup_steps,
        "optimizer": train.optimizer,
        "epochs": plan.epochs,
        "steps_per_epoch": train_result.steps_per_epoch,
        "total_steps": train_result.total_steps,
        "seed": train.seed,
        "deterministic": train.deterministic,
        "mixed_precision": train.mixed_precision,
        "jit_compile": train.jit_compile,
        "shuffle": train.shuffle,
        "early_stopping": train.early_stopping.enabled,
        "early_stopping_metric": train_result.early_stopping_metric,
        "early_stopping_patience": train.early_stopping.patience,
        "early_stopping_min_delta": train.early_stopping.min_delta,
        # How training ended: an early stop (its step and best step) or the planned steps, and why.
        "stopped_early": train_result.stopped_early,
        "stopped_at_step": train_result.stopped_at_step,
        "best_step": train_result.best_step,
        "stop_reason": train_result.stop_reason,
        "split_seed": config.data.split.seed,
        "model_factory": config.model.factory,
        "model_task": config.model.task.value,
        "config_hash": config.config_hash(),
        "data_fingerprint": manifest.fingerprint,
        "data_content_hash": manifest.content_hash(),
        "num_train_records": manifest.num_records("train"),
        "num_eval_records": manifest.num_records("eval"),
        "shard_policy": plan.policy.value,
        "shard_num_files": num_files,
        "shard_imbalance_ratio": round(plan.imbalance_ratio, 4),
        "shard_replicas_per_worker": plan.replicas_per_worker,
        "shard_plan": (f"{plan.policy.value} over {plan.num_workers} worker(s), {num_files} file(s), "
                       f"imbalance {plan.imbalance_ratio:.3f}, {len(plan.warnings)} warning(s)"),
    }
    for package, version in versions.items():
        name = package if package.endswith("_version") else f"{package}_version"
        params[name] = version
    return params
