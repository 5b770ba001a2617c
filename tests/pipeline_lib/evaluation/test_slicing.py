"""Metrics per slice (feature keys and numeric buckets), the slice gate, and the evaluation plots."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import special
from sklearn.calibration import calibration_curve
from sklearn.metrics import precision_recall_curve, roc_auc_score, roc_curve

from pipeline_lib.config import BucketSlice, EvaluationConfig, GateConfig, Task
from pipeline_lib.evaluation import metrics as evaluation
from pipeline_lib.evaluation import plots
from pipeline_lib.evaluation.gate import apply_gate
from pipeline_lib.evaluation.report import EvalReport
from pipeline_lib.evaluation.slicing import SliceError, SliceResult
from tests.conftest import generate_rows
from tests.pipeline_lib.evaluation.conftest import NUM_EVAL


def _expected(weights, bias):
    rows = generate_rows(NUM_EVAL, 1)  # the eval rows write_dataset wrote
    numeric = np.array([np.concatenate([r["x"], [r["size"]]]) for r in rows], dtype=np.float64)
    labels = np.array([r["label"] for r in rows])
    correct = (numeric @ weights + bias).argmax(axis=1) == labels
    return rows, correct


def test_metrics_per_string_key_bucket_and_key_pair_match_hand_computation(classification_setup):
    manifest, model, weights, bias = classification_setup
    rows, correct = _expected(weights, bias)
    colors = np.array([r["color"] for r in rows])
    sizes = np.array([r["size"] for r in rows])

    report = evaluation.evaluate_model(model, manifest, Task.CLASSIFICATION, batch_size=16,
                                       slices=[("color",), BucketSlice(feature="size", boundaries=(1, 3)),
                                               ("color", "size")])

    by_key = {r.key: r for r in report.slices}
    for color in ("red", "green", "blue"):
        mask = colors == color
        assert by_key[f"color={color}"].num_examples == mask.sum()
        assert by_key[f"color={color}"].metrics["accuracy"] == pytest.approx(correct[mask].mean())
    buckets = {"size=<1": sizes < 1, "size=[1,3)": (sizes >= 1) & (sizes < 3), "size=≥3": sizes >= 3}
    for key, mask in buckets.items():
        assert by_key[key].num_examples == mask.sum()
        assert by_key[key].metrics["accuracy"] == pytest.approx(correct[mask].mean())
    pairs = [r for r in report.slices if r.spec == "color, size"]
    assert sum(r.num_examples for r in pairs) == NUM_EVAL
    red_two = (colors == "red") & (sizes == 2)
    assert by_key["color=red, size=2"].num_examples == red_two.sum()
    assert by_key["color=red, size=2"].metrics["accuracy"] == pytest.approx(correct[red_two].mean())
    assert "## Metrics per slice" in report.to_markdown()


def test_a_slice_naming_an_unknown_or_a_string_feature_for_buckets_is_a_clear_error(classification_setup):
    manifest, model, _, _ = classification_setup
    with pytest.raises(SliceError, match=r"evaluation.slices\[0\] \(region\) names feature 'region'.*use one of"):
        evaluation.evaluate_model(model, manifest, "classification", slices=[("region",)])
    with pytest.raises(SliceError, match=r"buckets 'color', a string feature"):
        evaluation.evaluate_model(model, manifest, "classification",
                                  slices=[BucketSlice(feature="color", boundaries=(1,))])


def test_slice_config_rejects_unsorted_boundaries_and_repeated_keys():
    with pytest.raises(ValueError, match=r"must increase strictly"):
        EvaluationConfig.model_validate({"slices": [{"feature": "age", "boundaries": [35, 18]}]})
    with pytest.raises(ValueError, match=r"distinct features"):
        EvaluationConfig.model_validate({"slices": [["region", "region"]]})


def _report(accuracy: float, slices: list[tuple[str, int, float]]) -> EvalReport:
    return EvalReport(task="classification", metrics={"accuracy": accuracy}, num_examples=sum(n for _, n, _ in slices),
                      slices=[SliceResult(spec="region", key=f"region={name}", values={"region": name},
                                          num_examples=n, metrics={"accuracy": a}) for name, n, a in slices])


def test_the_slice_gate_fails_on_a_large_enough_slice_below_the_threshold_and_names_it():
    gate = GateConfig(metric="accuracy", threshold=0.8, slice_threshold=0.75, min_slice_examples=30)
    report = _report(0.9, [("north", 200, 0.97), ("south", 60, 0.62), ("tiny", 5, 0.0)])
    decision = apply_gate(report, gate)
    assert not decision.blessed and decision.failing_slices == ("region=south",)
    assert "region=south (accuracy 0.6200, 60 examples)" in decision.reason and "tiny" not in decision.reason

    passing = apply_gate(_report(0.9, [("north", 200, 0.97), ("south", 60, 0.8), ("tiny", 5, 0.0)]), gate)
    assert passing.blessed and passing.failing_slices == ()
    assert "every slice with ≥ 30 examples (2 of 3)" in passing.reason


def test_slice_metric_names_are_valid_mlflow_names():
    from mlflow.utils.validation import _validate_metric_name

    result = SliceResult(spec="age (buckets 18, 35)", key="age=[18,35)", values={"age": "[18,35)"},
                         num_examples=3, metrics={"accuracy": 1.0})
    name = result.metric_name("accuracy")
    assert name == "slice.age:_18_35_.accuracy"
    _validate_metric_name(name)  # raises on a bad name
    _validate_metric_name(SliceResult(spec="r, d", key="r=eu, d=mobile", values={"r": "eu", "d": "mobile"},
                                      num_examples=1, metrics={}).metric_name("auc"))


def test_classification_plots_are_pngs_and_their_curves_match_sklearn(tmp_path):
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 3, size=300)
    logits = rng.normal(size=(300, 3)) + 2.0 * np.eye(3)[labels]
    probs = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)

    figures = plots.evaluation_figures(Task.CLASSIFICATION, labels, logits, ["cat", "dog", "owl"])
    written = plots.write_plots(figures, str(tmp_path / "plots"))

    assert set(written) == {"confusion_matrix", "roc", "precision_recall", "calibration"}
    for uri in written.values():
        with open(uri, "rb") as handle:
            assert handle.read(8) == b"\x89PNG\r\n\x1a\n"
    labels_drawn = [t.get_text() for t in figures["confusion_matrix"].axes[0].get_xticklabels()]
    assert labels_drawn == ["cat", "dog", "owl"]
    roc_line = figures["roc"].axes[0].lines[1]  # one line per class, then the diagonal
    sk_fpr, sk_tpr, _ = roc_curve(labels == 1, probs[:, 1])
    np.testing.assert_allclose(roc_line.get_xydata(), np.column_stack([sk_fpr, sk_tpr]))
    assert f"(AUC {roc_auc_score(labels == 1, probs[:, 1]):.3f})" in roc_line.get_label()
    precision, recall, _ = precision_recall_curve(labels == 1, probs[:, 1])
    np.testing.assert_allclose(figures["precision_recall"].axes[0].lines[1].get_xydata(),
                               np.column_stack([recall, precision]))
    top, confidence = probs.argmax(axis=1) == labels, probs.max(axis=1)
    frequency, mean_confidence = calibration_curve(top, confidence, n_bins=plots.CALIBRATION_BINS)
    model_line = figures["calibration"].axes[0].lines[1]
    np.testing.assert_allclose(model_line.get_xydata(), np.column_stack([mean_confidence, frequency]))
    counts = [int(text.get_text()) for text in figures["calibration"].axes[0].texts]
    assert sum(counts) == 300 and len(counts) == len(frequency)


def _curve_data(figures):
    return {name: [line.get_xydata() for line in figures[name].axes[0].lines]
            for name in ("roc", "precision_recall", "calibration")}


@pytest.mark.parametrize("num_classes", [2, 3])
def test_curves_of_tied_scores_do_not_depend_on_row_order(num_classes):
    # Scores rounded to 1 decimal: most rows tie with others of both classes, and a calibration bin's edge is hit.
    rng = np.random.default_rng(1)
    labels = rng.integers(0, num_classes, size=200)
    logits = np.round(rng.normal(size=(200, num_classes)) + np.eye(num_classes)[labels], 1)
    order = rng.permutation(200)

    first = _curve_data(plots.evaluation_figures(Task.CLASSIFICATION, labels, logits))
    shuffled = _curve_data(plots.evaluation_figures(Task.CLASSIFICATION, labels[order], logits[order]))

    for name, lines in first.items():
        assert len(lines) == len(shuffled[name])
        for line, other in zip(lines, shuffled[name]):  # the same points; a bin's mean sums in row order
            assert line.shape == other.shape
            np.testing.assert_allclose(line, other, rtol=1e-12)
    probs = special.softmax(logits, axis=1)  # as the plots compute them: equal logit gaps give equal floats
    fpr, tpr, _ = roc_curve(labels == 1, probs[:, 1])
    np.testing.assert_allclose(first["roc"][1 if num_classes > 2 else 0], np.column_stack([fpr, tpr]))


def test_regression_plots(tmp_path):
    targets = np.linspace(0, 1, 50)
    written = plots.write_plots(plots.evaluation_figures(Task.REGRESSION, targets, targets[:, None] + 0.1),
                                str(tmp_path))
    assert set(written) == {"predictions_vs_targets", "residuals"}
