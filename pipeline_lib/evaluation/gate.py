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


def _improvement(value: float, other: float, margin: float, direction: Direction) -> tuple[bool, float, str]:
    """Whether `value` beats `other` by `margin` in `direction` (strictly when the margin is 0: a tie does not
    beat), the improvement, and what it needs, for messages. The one rule for the champion and the trivial model."""
    improvement = value - other if direction == Direction.MAX else other - value
    better = improvement > _TOLERANCE if margin == 0 else improvement >= margin - _TOLERANCE
    word = "higher" if direction == Direction.MAX else "lower"
    needs = "> 0" if margin == 0 else f"≥ {margin:g}"
    return better, improvement, f"{improvement:+.4f} in the {word}-is-better direction; needs {needs}"


def decide(value: float | None, gate: GateConfig, min_improvement: float = 0.0, *,
           champion_value: float | None = None, champion_version: int | None = None,
           baseline_value: float | None = None, baseline_model: str | None = None) -> GateDecision:
    """The blessing rule.

    A model is blessed when it has a score, reaches `gate.threshold` (when set), beats the trivial predictor's
    score on the same eval split by more than `gate.baseline_margin` (when `gate.beat_baseline` and there is a
    trivial score: `baseline_value`) and, when there is a champion, beats the champion's score on the same eval
    split by at least `min_improvement` (strictly, when a margin is 0: a tie keeps the champion, a model that only
    ties the trivial one is not blessed). A missing or NaN score is never blessed. The direction is
    `metric_direction(gate.metric, gate.direction)`: lower is better for loss, mae and rmse.

    Args:
        value: the model's `gate.metric` on the eval split.
        gate: `evaluation.gate` (metric, direction, threshold, beat_baseline, baseline_margin), its metric resolved.
        min_improvement: `evaluation.effective_min_improvement`.
        champion_value: the champion's score on the same split; None when there is none or it has no score.
        champion_version: the champion's registered version; None when there is no champion.
        baseline_value: the trivial predictor's score on the same split; None when there is none.
        baseline_model: what the trivial predictor predicts (`train mean 152.1`), for the reason.

    Returns:
        The GateDecision.
    """
    direction = metric_direction(gate.metric, gate.direction)
    metric, threshold = gate.metric, gate.threshold
    has_champion = champion_version is not None or champion_value is not None
    checks_baseline = gate.beat_baseline and _is_number(baseline_value)

    def verdict(blessed: bool, reason: str) -> GateDecision:
        return GateDecision(blessed=blessed, reason=reason, metric=metric, direction=direction.value, value=value,
                            threshold=threshold, champion_value=champion_value, champion_version=champion_version,
                            min_improvement=min_improvement,
                            baseline_value=baseline_value if checks_baseline else None,
                            baseline_margin=gate.baseline_margin)

    if not _is_number(value):
        return verdict(False, f"the model has no {metric} score ({value})")
    assert value is not None
    if threshold is not None and not reaches_threshold(value, threshold, direction):
        return verdict(False, f"{metric} {value:.4f} misses evaluation.gate.threshold "
                              f"({threshold_text(threshold, direction)})")
    passed = f"{metric} {value:.4f}" + (f" reaches {threshold_text(threshold, direction)}" if threshold is not None
                                        else "")
    name = f"champion v{champion_version}" if champion_version is not None else "the champion"
    if checks_baseline:
        assert baseline_value is not None
        better, _, how = _improvement(value, baseline_value, gate.baseline_margin, direction)
        trivial = f"the trivial model ({baseline_model})" if baseline_model else "the trivial model"
        comparison = f"{metric} {value:.4f} vs {trivial} {baseline_value:.4f} on the same eval split ({how})"
        if not better:
            also = (f"; {name} has {metric} {champion_value:.4f} there" if _is_number(champion_value)
                    else "")
            return verdict(False, f"does not beat the trivial model: {comparison} "
                                  f"(evaluation.gate.beat_baseline, baseline_margin){also}")
        passed += f"; beats {trivial} {baseline_value:.4f} on the same eval split ({how})"
    if not has_champion:
        return verdict(True, f"{passed}; no champion yet")
    if not _is_number(champion_value):
        return verdict(True, f"{passed}; {name} has no {metric} score ({champion_value}) on this eval split")
    assert champion_value is not None
    better, _, how = _improvement(value, champion_value, min_improvement, direction)
    comparison = f"{metric} {value:.4f} vs {name} {champion_value:.4f} on the same eval split ({how})"
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
    """`decide` on a report: its score, its trivial predictor's (`EvalReport.baseline`), and the champion's report
    of the same eval split when there is a champion; then `evaluation.gate.slice_threshold` on the slices, and the
    model check (`with_model_check`) when it ran. A gate without a metric takes the report's task's.

    Raises:
        EvaluationError: when the report does not have `gate.metric`.
    """
    return with_model_check(_gate_report(report, gate, min_improvement, champion, champion_version), validation)


def _gate_report(report: EvalReport, gate: GateConfig, min_improvement: float, champion: EvalReport | None,
                 champion_version: int | None) -> GateDecision:
    try:
        gate = gate.for_task(report.task)
    except ValueError as error:
        raise EvaluationError(str(error)) from None
    value = report.metrics.get(gate.metric)
    if value is None:
        raise EvaluationError(
            f"evaluation.gate.metric ({gate.metric!r}) is not among the {report.task} metrics "
            f"{sorted(report.metrics)}; choose one of those"
        )
    champion_value = None if champion is None else champion.metrics.get(gate.metric)
    decision = decide(value, gate, min_improvement, champion_value=champion_value,
                      champion_version=champion_version if champion is not None else None,
                      baseline_value=report.baseline.get(gate.metric), baseline_model=report.baseline_model)
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
