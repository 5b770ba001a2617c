"""The evaluation report as Markdown and JSON."""

from __future__ import annotations

import json

import pytest

from pipeline_lib.config import GateConfig
from pipeline_lib.evaluation import metrics as evaluation
from pipeline_lib.evaluation.gate import apply_gate


def test_report_markdown_and_json(classification_setup):
    manifest, model, _, _ = classification_setup
    report = evaluation.evaluate_model(model, manifest, "classification")
    report = report.model_copy(update={"gate": apply_gate(report, GateConfig(threshold=0.0))})
    markdown = report.to_markdown()
    assert "| accuracy |" in markdown and "Confusion matrix" in markdown
    assert f"| **0** | {' | '.join(str(c) for c in report.confusion_matrix[0])} |" in markdown
    assert "**Gate: blessed.**" in markdown
    payload = json.loads(report.to_json())
    assert payload["confusion_matrix"] == report.confusion_matrix
    assert payload["metrics"]["accuracy"] == pytest.approx(report.metrics["accuracy"])
    assert payload["gate"]["blessed"] is True
