"""Evaluation metrics against hand computations on a tiny linear model over generated TFRecords."""

from __future__ import annotations

import math

import numpy as np
import pytest
from sklearn.metrics import confusion_matrix as sk_confusion_matrix
from sklearn.metrics import roc_auc_score

from pipeline_lib.config import GateConfig, Task, parse_config
from pipeline_lib.evaluation import metrics as evaluation
from pipeline_lib.evaluation.gate import apply_gate
from tests.conftest import NUM_CLASSES, generate_rows, write_dataset
from tests.pipeline_lib.evaluation.conftest import NUM_EVAL, linear_model


def _eval_numeric(task: str, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The eval rows write_dataset writes (seed + 1), as the "numeric" vector [x(4), size] and labels."""
    rows = generate_rows(NUM_EVAL, seed + 1, task)
    numeric = np.array([np.concatenate([r["x"], [r["size"]]]) for r in rows], dtype=np.float64)
    labels = np.array([r["label"] for r in rows])
    return numeric, labels


def test_classification_metrics_match_hand_computation(classification_setup):
    manifest, model, weights, bias = classification_setup
    numeric, labels = _eval_numeric("classification")
    logits = numeric @ weights + bias
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    expected_loss = -log_probs[np.arange(NUM_EVAL), labels].mean()
    predicted = logits.argmax(axis=1)
    probs = np.exp(log_probs)

    report = evaluation.evaluate_model(model, manifest, Task.CLASSIFICATION, batch_size=16)

    assert report.num_examples == NUM_EVAL
    assert report.metrics["loss"] == pytest.approx(expected_loss, rel=1e-5)
    assert report.metrics["accuracy"] == pytest.approx((predicted == labels).mean())
    assert report.metrics["auc"] == pytest.approx(
        roc_auc_score(labels, probs, multi_class="ovr", average="macro"), rel=1e-5)
    assert report.confusion_matrix == sk_confusion_matrix(labels, predicted, labels=range(NUM_CLASSES)).tolist()
    assert sum(map(sum, report.confusion_matrix)) == NUM_EVAL
    assert report.gate is None


def test_batch_size_does_not_change_metrics(classification_setup):
    manifest, model, _, _ = classification_setup
    small = evaluation.evaluate_model(model, manifest, "classification", batch_size=7)
    whole = evaluation.evaluate_model(model, manifest, "classification", batch_size=256)
    assert small.confusion_matrix == whole.confusion_matrix
    for name, value in whole.metrics.items():
        assert small.metrics[name] == pytest.approx(value, rel=1e-6)


def test_binary_auc_by_hand_with_ties():
    # Pairs (pos, neg): (0.35 > 0.1), (0.35 < 0.4), (0.8 > both), (0.4 tie 0.4) -> (1 + 0 + 2 + 0.5 + 1) / 6
    is_positive = np.array([0, 0, 1, 1, 1])
    scores = np.array([0.1, 0.4, 0.35, 0.8, 0.4])
    assert evaluation.binary_auc(is_positive, scores) == pytest.approx(4.5 / 6)
    assert evaluation.binary_auc(is_positive, scores) == pytest.approx(roc_auc_score(is_positive, scores))
    assert math.isnan(evaluation.binary_auc(np.array([1, 1]), np.array([0.2, 0.3])))


def test_two_classes_use_the_positive_probability():
    labels = np.array([0, 1, 1, 0, 1])
    logits = np.array([[2.0, 0.0], [0.0, 1.0], [1.0, 0.5], [0.0, 0.2], [0.0, 3.0]])
    metrics, matrix = evaluation.classification_metrics(labels, logits)
    probs = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    assert metrics["auc"] == pytest.approx(roc_auc_score(labels, probs[:, 1]))
    assert metrics["accuracy"] == pytest.approx(3 / 5)
    assert matrix == [[1, 1], [1, 2]]


def test_labels_outside_the_model_outputs_name_the_fix():
    with pytest.raises(evaluation.EvaluationError, match=r"labels span 0\.\.3 .* 3 classes; set model.num_classes"):
        evaluation.classification_metrics(np.array([0, 3]), np.zeros((2, 3)))


def test_regression_metrics_match_hand_computation(tmp_path):
    manifest = write_dataset(str(tmp_path / "reg"), num_train=8, num_eval=NUM_EVAL, task="regression")
    rng = np.random.default_rng(3)
    weights, bias = rng.normal(size=(5, 1)), rng.normal(size=1)
    model = linear_model(manifest.feature_schema, weights, bias)
    numeric, targets = _eval_numeric("regression")
    errors = (numeric @ weights + bias).reshape(-1) - targets

    report = evaluation.evaluate_model(model, manifest, Task.REGRESSION, batch_size=16)

    assert report.metrics["loss"] == pytest.approx(np.mean(errors ** 2), rel=1e-5)
    assert report.metrics["mae"] == pytest.approx(np.mean(np.abs(errors)), rel=1e-5)
    assert report.metrics["rmse"] == pytest.approx(math.sqrt(np.mean(errors ** 2)), rel=1e-5)
    assert report.metrics["r2"] == pytest.approx(1 - np.mean(errors ** 2) / np.var(targets), rel=1e-5)
    assert report.confusion_matrix is None
    assert set(report.metrics) == {"loss", "mae", "rmse", "r2"}


def test_evaluate_loads_the_keras_file_and_applies_the_gate(classification_setup, tmp_path):
    manifest, model, _, _ = classification_setup
    path = str(tmp_path / "model.keras")
    model.save(path)
    direct = evaluation.evaluate_model(model, manifest, "classification")
    config = parse_config({
        "data": {"source": "unused.csv", "label": "label"},
        "output_root": str(tmp_path),
        "evaluation": {"gate": {"metric": "accuracy", "threshold": direct.metrics["accuracy"]}},
    })

    report = evaluation.evaluate(config, manifest, path)

    assert report.metrics == pytest.approx(direct.metrics)
    assert report.gate is None  # the gate is decided after, with the champion (evaluation.gate.apply_gate)
    assert report.model_path == path
    assert apply_gate(report, config.evaluation.gate).blessed
    strict = GateConfig(metric="accuracy", threshold=direct.metrics["accuracy"] + 0.01)
    failed = apply_gate(report, strict)
    assert not failed.blessed and "misses evaluation.gate.threshold (≥" in failed.reason


def test_missing_model_file_names_the_path(tiny_manifest, tmp_path):
    config = parse_config({"data": {"source": "unused.csv", "label": "label"}, "output_root": str(tmp_path)})
    missing = str(tmp_path / "nope.keras")
    with pytest.raises(evaluation.EvaluationError, match="nope.keras"):
        evaluation.evaluate(config, tiny_manifest, missing)
