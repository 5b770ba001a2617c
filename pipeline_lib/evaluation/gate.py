"""The evaluation gate: the one decision whether a model is blessed, for the pipeline and the retrain flow."""

from __future__ import annotations

import math

from pipeline_lib.config import Direction, GateConfig, metric_direction
from pipeline_lib.evaluation.report import EvalReport, EvaluationError, GateDecision
from pipeline_lib.serving.validation import ModelValidation

# Keeps 0.95 - 0.90 (0.04999…) a win by a 0.05 margin.
_TOLERANCE = 1e-9


def reaches_threshold(value: float | None, threshold: float, direction: Direction) -> bool:
    """Whether `value` is at least `threshold` (MAX) or at most it (MIN); a missing or NaN value never is."""
    if value is None or math.isnan(value):
        return False
    return value >= threshold if direction == Direction.MAX else value <= threshold


def threshold_text(threshold: float, direction: Direction) -> str:
    """`≥ 0.9` or `≤ 0.2`: what the metric needs, for messages."""
    return f"{'≥' if direction == Direction.MAX else '≤'} {threshold:g}"


def _is_number(value: float | None) -> bool:
    return value is not None and not math.isnan(value)


def decide(value: float | None, gate: GateConfig, min_improvement: float = 0.0, *,
           champion_value: float | None = None, champion_version: int | None = None) -> GateDecision:
    """The blessing rule.

    A model is blessed when it reaches `gate.threshold` (when set) and, when there is a champion, beats the
    champion's score on the same eval split by at least `min_improvement` in the metric's direction (strictly,
    when the margin is 0: a tie keeps the champion). With no champion, passing the threshold blesses. A NaN score
    is never blessed; a missing score is blessed only when there is nothing to check (no threshold, no champion).
    The direction is `metric_direction(gate.metric, gate.direction)`: lower is better for loss, mae and rmse.

    Args:
        value: the model's `gate.metric` on the eval split.
        gate: `evaluation.gate` (metric, direction, threshold).
        min_improvement: `evaluation.effective_min_improvement`.
        champion_value: the champion's score on the same split; None when there is none or it has no score.
        champion_version: the champion's registered version; None when there is no champion.

    Returns:
        The GateDecision.
    """
    direction = metric_direction(gate.metric, gate.direction)
    metric, threshold = gate.metric, gate.threshold
    has_champion = champion_version is not None or champion_value is not None

    def verdict(blessed: bool, reason: str) -> GateDecision:
        return GateDecision(blessed=blessed, reason=reason, metric=metric, direction=direction.value, value=value,
                            threshold=threshold, champion_value=champion_value, champion_version=champion_version,
                            min_improvement=min_improvement)

    if value is None and threshold is None and not has_champion:
        return verdict(True, f"no evaluation.gate.threshold and no champion: nothing to gate ({metric} n/a)")
    if not _is_number(value):
        return verdict(False, f"the model has no {metric} score ({value})")
    assert value is not None
    if threshold is not None and not reaches_threshold(value, threshold, direction):
        return verdict(False, f"{metric} {value:.4f} misses evaluation.gate.threshold "
                              f"({threshold_text(threshold, direction)})")
    passed = f"{metric} {value:.4f}" + (f" reaches {threshold_text(threshold, direction)}" if threshold is not None
                                        else "")
    if not has_champion:
        return verdict(True, f"{passed}; no champion yet")
    name = f"champion v{champion_version}" if champion_version is not None else "the champion"
    if not _is_number(champion_value):
        return verdict(True, f"{passed}; {name} has no {metric} score ({champion_value}) on this eval split")
    assert champion_value is not None
    improvement = value - champion_value if direction == Direction.MAX else champion_value - value
    better = improvement > _TOLERANCE if min_improvement == 0 else improvement >= min_improvement - _TOLERANCE
    word = "higher" if direction == Direction.MAX else "lower"
    comparison = (f"{metric} {value:.4f} vs {name} {champion_value:.4f} on the same eval split "
                  f"({improvement:+.4f} in the {word}-is-better direction; "
                  f"needs {'> 0' if min_improvement == 0 else f'≥ {min_improvement:g}'})")
    return verdict(better, ("beats the champion: " if better else "does not beat the champion: ") + comparison)


def with_model_check(decision: GateDecision, validation: ModelValidation | None) -> GateDecision:
    """The decision, not blessed when the model check before registration failed (its reason first: the loader,
    the error and the fix); unchanged when the check passed or did not run."""
    if validation is None or validation.passed:
        return decision
    return decision.model_copy(update={"blessed": False,
                                       "reason": f"{validation.reason}; the evaluation gate: {decision.reason}"})


def apply_gate(report: EvalReport, gate: GateConfig, min_improvement: float = 0.0, *,
               champion: EvalReport | None = None, champion_version: int | None = None,
               validation: ModelValidation | None = None) -> GateDecision:
    """`decide` on a report, and on the champion's report of the same eval split when there is a champion; then
    `evaluation.gate.slice_threshold` on the slices, and the model check (`with_model_check`) when it ran.

    Raises:
        EvaluationError: when a threshold or a champion needs `gate.metric` and the report does not have it.
    """
    return with_model_check(_gate_report(report, gate, min_improvement, champion, champion_version), validation)


def _gate_report(report: EvalReport, gate: GateConfig, min_improvement: float, champion: EvalReport | None,
                 champion_version: int | None) -> GateDecision:
    value = report.metrics.get(gate.metric)
    if value is None and (gate.threshold is not None or champion is not None):
        raise EvaluationError(
            f"evaluation.gate.metric ({gate.metric!r}) is not among the {report.task} metrics "
            f"{sorted(report.metrics)}; choose one of those"
        )
    champion_value = None if champion is None else champion.metrics.get(gate.metric)
    decision = decide(value, gate, min_improvement, champion_value=champion_value,
                      champion_version=champion_version if champion is not None else None)
    if gate.slice_threshold is None or not report.slices:
        return decision
    direction = metric_direction(gate.metric, gate.direction)
    judged = [s for s in report.slices if s.num_examples >= gate.min_slice_examples]
    failing = [s for s in judged if not reaches_threshold(s.metrics.get(gate.metric), gate.slice_threshold, direction)]
    if not failing:
        note = (f"; every slice with ≥ {gate.min_slice_examples} examples ({len(judged)} of {len(report.slices)}) "
                f"reaches evaluation.gate.slice_threshold ({threshold_text(gate.slice_threshold, direction)})")
        return decision.model_copy(update={"reason": decision.reason + note})
    named = ", ".join(f"{s.key} ({gate.metric} {s.metrics.get(gate.metric, float('nan')):.4f}, "
                      f"{s.num_examples} examples)" for s in failing)
    reason = (f"slice(s) below evaluation.gate.slice_threshold ({threshold_text(gate.slice_threshold, direction)}): "
              f"{named}")
    if not decision.blessed:
        reason = f"{decision.reason}; and {reason}"
    return decision.model_copy(update={"blessed": False, "reason": reason,
                                       "failing_slices": tuple(s.key for s in failing)})
