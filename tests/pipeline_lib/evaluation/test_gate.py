"""The evaluation gate: thresholds in each direction, lower-is-better metrics, a missing metric, the champion."""

from __future__ import annotations

import math

import pytest

from pipeline_lib.config import Direction, GateConfig
from pipeline_lib.evaluation import gate
from pipeline_lib.evaluation.report import EvalReport, EvaluationError


def test_gate_directions_and_missing_metric():
    report = EvalReport(task="regression", metrics={"loss": 0.5, "mae": 0.4, "rmse": 0.7},
                                   num_examples=3)
    # Lower is better for mae whatever the configured direction says.
    assert gate.apply_gate(report, GateConfig(metric="mae", threshold=0.5)).blessed
    assert not gate.apply_gate(report, GateConfig(metric="mae", threshold=0.3)).blessed
    # A gate metric the task does not compute is an error, threshold or not: never "nothing to gate".
    with pytest.raises(EvaluationError, match=r"evaluation.gate.metric \('accuracy'\) is not a metric model.task "
                                              r"regression computes; choose one of \['loss', 'mae', 'rmse', 'r2'\]"):
        gate.apply_gate(report, GateConfig(metric="accuracy"))
    with pytest.raises(EvaluationError, match=r"evaluation.gate.metric \('r2'\) is not among the regression metrics"):
        gate.apply_gate(report, GateConfig(metric="r2", threshold=0.9))



@pytest.mark.parametrize("metric", ["loss", "mae", "rmse"])
def test_lower_is_better_metrics_gate_on_a_maximum_whatever_the_direction(metric):
    report = EvalReport(task="regression", metrics={"loss": 0.5, "mae": 0.5, "rmse": 0.5}, num_examples=3)
    verdict = gate.apply_gate(report, GateConfig(metric=metric, direction=Direction.MAX, threshold=0.6))
    assert verdict.blessed and verdict.direction == "min"
    assert verdict.reason == f"{metric} 0.5000 reaches ≤ 0.6; no champion yet"


def test_reaches_threshold_in_both_directions_and_never_for_nan_or_none():
    assert gate.reaches_threshold(0.9, 0.9, Direction.MAX) and not gate.reaches_threshold(0.89, 0.9, Direction.MAX)
    assert gate.reaches_threshold(0.2, 0.2, Direction.MIN) and not gate.reaches_threshold(0.21, 0.2, Direction.MIN)
    assert not gate.reaches_threshold(math.nan, 0.0, Direction.MAX)
    assert not gate.reaches_threshold(None, 0.0, Direction.MIN)
    assert gate.threshold_text(0.9, Direction.MAX) == "≥ 0.9" and gate.threshold_text(0.2, Direction.MIN) == "≤ 0.2"


MAX_ACC = GateConfig(metric="accuracy", direction=Direction.MAX)


def test_the_first_model_is_blessed_unless_it_misses_the_threshold():
    decision = gate.decide(0.5, MAX_ACC)
    assert decision.blessed and "no champion yet" in decision.reason
    refused = gate.decide(0.5, GateConfig(metric="accuracy", threshold=0.9))
    assert not refused.blessed
    assert (refused.metric, refused.value, refused.threshold, refused.champion_value) == ("accuracy", 0.5, 0.9, None)
    assert refused.reason == "accuracy 0.5000 misses evaluation.gate.threshold (≥ 0.9)"


@pytest.mark.parametrize("challenger, champion, margin, blessed", [
    (0.95, 0.90, 0.0, True),
    (0.90, 0.90, 0.0, False),  # a tie keeps the champion
    (0.80, 0.90, 0.0, False),
    (0.92, 0.90, 0.05, False),  # better, but not by the margin
    (0.95, 0.90, 0.05, True),
])
def test_higher_is_better_with_a_margin_over_the_champion(challenger, champion, margin, blessed):
    decision = gate.decide(challenger, MAX_ACC, margin, champion_value=champion, champion_version=3)
    assert decision.blessed is blessed
    assert "v3" in decision.reason
    assert (decision.value, decision.champion_value, decision.champion_version) == (challenger, champion, 3)


@pytest.mark.parametrize("metric", ["loss", "mae", "rmse"])
def test_loss_mae_and_rmse_are_lower_is_better_against_the_champion_too(metric):
    config = GateConfig(metric=metric, direction=Direction.MAX)
    better = gate.decide(0.2, config, champion_value=0.3, champion_version=1)
    assert better.blessed and better.direction == "min"
    assert not gate.decide(0.4, config, champion_value=0.3, champion_version=1).blessed
    refused = gate.decide(0.3, config.model_copy(update={"threshold": 0.25}))
    assert not refused.blessed and "misses evaluation.gate.threshold (≤ 0.25)" in refused.reason


def test_min_direction_on_a_custom_metric():
    config = GateConfig(metric="auc", direction=Direction.MIN)
    assert gate.decide(0.1, config, 0.05, champion_value=0.2, champion_version=1).blessed
    assert not gate.decide(0.18, config, 0.05, champion_value=0.2, champion_version=1).blessed


def test_a_nan_model_is_never_blessed_and_a_nan_champion_is_replaced():
    assert not gate.decide(math.nan, MAX_ACC, champion_value=0.9, champion_version=1).blessed
    assert not gate.decide(math.nan, MAX_ACC).blessed
    assert gate.decide(0.5, MAX_ACC, champion_value=math.nan, champion_version=1).blessed


def test_apply_gate_compares_with_the_champions_report_of_the_same_split():
    report = EvalReport(task="classification", metrics={"accuracy": 0.88}, num_examples=3)
    champion = EvalReport(task="classification", metrics={"accuracy": 0.91}, num_examples=3)
    decision = gate.apply_gate(report, GateConfig(metric="accuracy", threshold=0.8), champion=champion,
                               champion_version=2)
    assert not decision.blessed and decision.champion_value == 0.91 and decision.threshold == 0.8
    assert "does not beat the champion" in decision.reason and "champion v2 0.9100" in decision.reason
    regression = EvalReport(task="regression", metrics={"mae": 0.1}, num_examples=3)
    with pytest.raises(EvaluationError, match="is not a metric model.task regression computes"):
        gate.apply_gate(regression, MAX_ACC, champion=regression, champion_version=1)


def _model_check(passed: bool):
    from pipeline_lib.serving.validation import LoaderCheck, ModelValidation

    check = LoaderCheck(loader="tf.saved_model.load", uri="export/saved_model", passed=passed,
                        max_abs_diff=0.0 if passed else None, error=None if passed else "OSError: truncated",
                        fix=None if passed else "re-export it")
    reason = "passed" if passed else f"the model check failed: {check.describe()}"
    return ModelValidation(passed=passed, reason=reason, checks=(check,), rows=8, rows_with_missing=2,
                           tolerance=1e-5, max_abs_diff=check.max_abs_diff, seconds=1.0)


def test_a_failed_model_check_refuses_a_model_the_metrics_bless_and_leads_the_reason():
    report = EvalReport(task="classification", metrics={"accuracy": 0.95}, num_examples=3)
    config = GateConfig(metric="accuracy", threshold=0.9)
    assert gate.apply_gate(report, config, validation=_model_check(True)) == gate.apply_gate(report, config)
    refused = gate.apply_gate(report, config, validation=_model_check(False))
    assert not refused.blessed and refused.value == 0.95 and refused.threshold == 0.9
    assert refused.reason.startswith("the model check failed: tf.saved_model.load('export/saved_model') in a fresh "
                                     "process without tfdag: OSError: truncated; fix: re-export it; the evaluation "
                                     "gate: accuracy 0.9500 reaches ≥ 0.9")


def test_the_gate_blesses_only_a_model_that_beats_the_trivial_one_and_names_both_values():
    rmse = GateConfig(metric="rmse")
    refused = gate.decide(80.0, rmse, baseline_value=77.0, baseline_model="train mean 152.1")
    assert not refused.blessed and refused.baseline_value == 77.0
    assert refused.reason == ("does not beat the trivial model: rmse 80.0000 vs the trivial model (train mean 152.1) "
                              "77.0000 on the same eval split (-3.0000 in the lower-is-better direction; needs > 0) "
                              "(evaluation.gate.beat_baseline, baseline_margin)")
    assert not gate.decide(77.0, rmse, baseline_value=77.0).blessed  # a tie with the trivial model is no win
    blessed = gate.decide(55.0, rmse, baseline_value=77.0, baseline_model="train mean 152.1")
    assert blessed.blessed and blessed.reason == (
        "rmse 55.0000; beats the trivial model (train mean 152.1) 77.0000 on the same eval split (+22.0000 in the "
        "lower-is-better direction; needs > 0); no champion yet")
    with_threshold = gate.decide(55.0, rmse.model_copy(update={"threshold": 60.0}), baseline_value=77.0)
    assert with_threshold.reason.startswith("rmse 55.0000 reaches ≤ 60; beats the trivial model 77.0000")
    # A margin, and the switch.
    assert not gate.decide(70.0, rmse.model_copy(update={"baseline_margin": 10.0}), baseline_value=77.0).blessed
    assert gate.decide(80.0, rmse.model_copy(update={"beat_baseline": False}), baseline_value=77.0).blessed
    # The champion is judged after the trivial model.
    both = gate.decide(55.0, rmse, baseline_value=77.0, champion_value=50.0, champion_version=4)
    assert not both.blessed and both.reason.startswith("does not beat the champion")


def test_apply_gate_takes_the_trivial_score_from_the_report_and_the_tasks_default_metric():
    report = EvalReport(task="classification", metrics={"loss": 1.0, "accuracy": 0.30, "auc": 0.6}, num_examples=9,
                        baseline={"loss": 1.1, "accuracy": 0.34, "auc": 0.5}, baseline_model="majority class 2")
    decision = gate.apply_gate(report, GateConfig())  # no metric: the task's (accuracy)
    assert (decision.metric, decision.value, decision.baseline_value) == ("accuracy", 0.30, 0.34)
    assert not decision.blessed and "the trivial model (majority class 2) 0.3400" in decision.reason
    assert gate.apply_gate(report, GateConfig(metric="auc")).blessed
    # A report without a trivial score (a dataset without statistics) is gated as before.
    bare = report.model_copy(update={"baseline": {}, "baseline_model": None})
    assert gate.apply_gate(bare, GateConfig()).blessed


def test_a_model_refused_by_the_trivial_model_also_names_the_champions_score():
    decision = gate.decide(0.05, MAX_ACC, baseline_value=0.10, baseline_model="majority class 4", champion_value=0.9,
                           champion_version=2)
    assert not decision.blessed
    assert decision.reason.startswith("does not beat the trivial model: accuracy 0.0500 vs the trivial model")
    assert decision.reason.endswith("; champion v2 has accuracy 0.9000 there")
