"""The evaluation gate: whether a metric reaches `evaluation.gate.threshold`, for the pipeline and the retrain flow."""

from __future__ import annotations

import math

from pipeline_lib.config import Direction, GateConfig, metric_direction
from pipeline_lib.evaluation.report import EvalReport, EvaluationError, GateResult


def reaches_threshold(value: float | None, threshold: float, direction: Direction) -> bool:
    """Whether `value` is at least `threshold` (MAX) or at most it (MIN); a missing or NaN value never is."""
    if value is None or math.isnan(value):
        return False
    return value >= threshold if direction == Direction.MAX else value <= threshold


def threshold_text(threshold: float, direction: Direction) -> str:
    """`≥ 0.9` or `≤ 0.2`: what the metric needs, for messages."""
    return f"{'≥' if direction == Direction.MAX else '≤'} {threshold:g}"


def apply_gate(report: EvalReport, gate_config: GateConfig) -> GateResult:
    """Check a report against `evaluation.gate.threshold` (no threshold: the gate passes).

    The direction is `metric_direction(gate.metric, gate.direction)`: lower is better for loss, mae and rmse.

    Raises:
        EvaluationError: when a threshold is set on a metric the report does not have.
    """
    metric = gate_config.metric
    direction = metric_direction(metric, gate_config.direction)
    value = report.metrics.get(metric)
    threshold = gate_config.threshold
    if threshold is None:
        return GateResult(metric=metric, value=value, threshold=None, direction=direction.value, passed=True,
                          reason=f"no evaluation.gate.threshold set; {metric} = {_fmt(value)}")
    if value is None:
        raise EvaluationError(
            f"evaluation.gate.metric ({metric!r}) is not among the {report.task} metrics "
            f"{sorted(report.metrics)}; choose one of those"
        )
    return GateResult(metric=metric, value=value, threshold=threshold, direction=direction.value,
                      passed=reaches_threshold(value, threshold, direction),
                      reason=f"{metric} = {_fmt(value)}, needs {threshold_text(threshold, direction)}")


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"
