"""Best-checkpoint selection and retention: the metric to rank by, the best checkpoint, the ones to keep."""

from __future__ import annotations

from collections.abc import Iterable

from pipeline_lib.checkpoints.records import CheckpointRecord
from pipeline_lib.config import (
    CHECKPOINT_EVAL_METRICS,
    Direction,
    PipelineConfig,
    metric_direction,
)


def selection_metric(config: PipelineConfig) -> tuple[str, Direction]:
    """The checkpoint-manifest metric that `evaluation.select: best` ranks by, and its direction.

    `evaluation.gate.metric` (whose default follows `model.task`: accuracy, or rmse for regression) maps to the
    metric the training loop records (`accuracy` → `eval_accuracy`, `CHECKPOINT_EVAL_METRICS`: loss, accuracy;
    loss, mae, rmse, r2); the loop records no AUC per checkpoint, so an AUC gate ranks by `eval_loss`. The
    direction is `metric_direction(metric, evaluation.gate.direction)`: loss, mae and rmse are always minimised.
    """
    gate = config.evaluation.gate
    recorded = gate.metric in CHECKPOINT_EVAL_METRICS[config.model.task]
    metric = f"eval_{gate.metric}" if recorded else "eval_loss"
    return metric, metric_direction(metric, gate.direction)


def rank_by_metric(records: Iterable[CheckpointRecord], metric: str,
                   direction: Direction = Direction.MAX) -> list[CheckpointRecord]:
    """The checkpoints that record `metric`, best first; among equal values the newest first.

    The direction is `metric_direction(metric, direction)`: a loss ranks lowest first whatever is declared.
    """
    sign = -1.0 if metric_direction(metric, direction) == Direction.MAX else 1.0
    newest_first = sorted(records, key=lambda r: r.step, reverse=True)
    # sorted() is stable, so equal metrics keep the newest-first order.
    return sorted((r for r in newest_first if metric in r.metrics), key=lambda r: sign * r.metrics[metric])


def best_checkpoint(records: Iterable[CheckpointRecord], metric: str | None,
                    direction: Direction = Direction.MAX) -> CheckpointRecord | None:
    """The checkpoint with the best `metric` (the newest among ties); None when none records it."""
    ranked = rank_by_metric(records, metric, direction) if metric else []
    return ranked[0] if ranked else None


def steps_to_keep(records: Iterable[CheckpointRecord], keep: int, metric: str | None,
                  direction: Direction = Direction.MAX) -> set[int]:
    """Retention: the steps of the newest `keep` checkpoints plus the best one by `metric`."""
    records = sorted(records, key=lambda r: r.step)
    kept = {r.step for r in records[-keep:]}
    best = best_checkpoint(records, metric, direction)
    if best is not None:
        kept.add(best.step)
    return kept
