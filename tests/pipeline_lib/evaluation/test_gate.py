"""The evaluation gate: thresholds in each direction, lower-is-better metrics, a missing metric."""

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
    assert gate.apply_gate(report, GateConfig(metric="mae", threshold=0.5)).passed
    assert not gate.apply_gate(report, GateConfig(metric="mae", threshold=0.3)).passed
    assert gate.apply_gate(report, GateConfig(metric="accuracy")).passed  # no threshold: nothing to reach
    with pytest.raises(EvaluationError, match=r"evaluation.gate.metric \('accuracy'\) is not among"):
        gate.apply_gate(report, GateConfig(metric="accuracy", threshold=0.9))



@pytest.mark.parametrize("metric", ["loss", "mae", "rmse"])
def test_lower_is_better_metrics_gate_on_a_maximum_whatever_the_direction(metric):
    report = EvalReport(task="regression", metrics={"loss": 0.5, "mae": 0.5, "rmse": 0.5}, num_examples=3)
    verdict = gate.apply_gate(report, GateConfig(metric=metric, direction=Direction.MAX, threshold=0.6))
    assert verdict.passed and verdict.direction == "min"
    assert verdict.reason == f"{metric} = 0.5000, needs ≤ 0.6"


def test_reaches_threshold_in_both_directions_and_never_for_nan_or_none():
    assert gate.reaches_threshold(0.9, 0.9, Direction.MAX) and not gate.reaches_threshold(0.89, 0.9, Direction.MAX)
    assert gate.reaches_threshold(0.2, 0.2, Direction.MIN) and not gate.reaches_threshold(0.21, 0.2, Direction.MIN)
    assert not gate.reaches_threshold(math.nan, 0.0, Direction.MAX)
    assert not gate.reaches_threshold(None, 0.0, Direction.MIN)
    assert gate.threshold_text(0.9, Direction.MAX) == "≥ 0.9" and gate.threshold_text(0.2, Direction.MIN) == "≤ 0.2"
