"""The trivial predictor: the train split's majority class (string and integer labels) or mean, scored beside the
model on the same eval split."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline_lib.config import Task
from pipeline_lib.data.accumulators import NumericAccumulator
from pipeline_lib.data.manifest import DType, FeatureSpec, Schema
from pipeline_lib.data.statistics import (
    DatasetStatistics,
    FeatureStatistics,
    NumericStatistics,
    SplitStatistics,
    StringStatistics,
)
from pipeline_lib.evaluation import metrics as evaluation
from pipeline_lib.evaluation.trivial import trivial_predictor
from pipeline_lib.training import input_pipeline
from tests.conftest import write_dataset
from tests.pipeline_lib.evaluation.conftest import NUM_EVAL, linear_model


def _statistics(label: FeatureStatistics, eval_label: FeatureStatistics | None = None) -> DatasetStatistics:
    splits = {"train": SplitStatistics(num_rows=label.count, features={"label": label})}
    if eval_label is not None:
        splits["eval"] = SplitStatistics(num_rows=eval_label.count, features={"label": eval_label})
    return DatasetStatistics(label="label", splits=splits)


def _integer_labels(values: list[int]) -> FeatureStatistics:
    accumulator = NumericAccumulator()  # the conversion's own sketch of the label
    accumulator.add(np.asarray(values, dtype=np.int64))
    return FeatureStatistics(dtype=DType.INT64, numeric=accumulator.result())


def _schema(dtype=DType.INT64, vocabulary=None) -> Schema:
    return Schema(features=(FeatureSpec(name="x", dtype=DType.FLOAT32),), label=FeatureSpec(name="label", dtype=dtype),
                  label_vocabulary=vocabulary)


def test_integer_labels_predict_the_train_splits_majority_class_with_its_frequencies():
    # The eval split's majority (class 0) is not the train split's (class 2): the train split decides.
    statistics = _statistics(_integer_labels([2] * 5 + [0] * 3 + [1] * 2), _integer_labels([0] * 9))
    trivial = trivial_predictor(Task.CLASSIFICATION, _schema(), statistics, 3)
    assert trivial.description == "majority class 2 of the train split (50.0%)"
    outputs = trivial.outputs(4)
    assert outputs.shape == (4, 3) and (outputs.argmax(axis=1) == 2).all()
    probabilities = np.exp(outputs[0]) / np.exp(outputs[0]).sum()
    np.testing.assert_allclose(probabilities, [4 / 13, 3 / 13, 6 / 13])  # add-one smoothed frequencies


def test_string_labels_are_counted_by_value_and_named():
    label = FeatureStatistics(dtype=DType.STRING, string=StringStatistics(
        count=6, missing=0, values={"barolo": 1, "grignolino": 4, "nebbiolo": 1}))
    schema = _schema(vocabulary=("barolo", "grignolino", "nebbiolo"))
    trivial = trivial_predictor(Task.CLASSIFICATION, schema, _statistics(label), 3)
    assert trivial.outputs(1).argmax() == 1
    assert trivial.description == "majority class 'grignolino' of the train split (66.7%)"


def test_regression_predicts_the_train_mean_and_nothing_without_statistics():
    label = FeatureStatistics(dtype=DType.FLOAT32, numeric=NumericStatistics(count=4, missing=0, min=1.0, max=9.0,
                                                                              mean=152.125, variance=4.0))
    trivial = trivial_predictor(Task.REGRESSION, _schema(DType.FLOAT32), _statistics(label), 1)
    assert trivial.description == "train mean 152.125"
    np.testing.assert_array_equal(trivial.outputs(3), [[152.125]] * 3)
    assert trivial_predictor(Task.REGRESSION, _schema(DType.FLOAT32), None, 1) is None


def test_the_report_scores_the_trivial_predictor_on_the_same_split(tmp_path):
    manifest = write_dataset(str(tmp_path / "reg"), num_train=8, num_eval=NUM_EVAL, task="regression")
    model = linear_model(manifest.feature_schema, np.ones((5, 1)), np.zeros(1))
    label = FeatureStatistics(dtype=DType.FLOAT32, numeric=NumericStatistics(count=8, missing=0, min=0.0, max=1.0,
                                                                              mean=0.25, variance=1.0))
    trivial = trivial_predictor(Task.REGRESSION, manifest.feature_schema, _statistics(label), 1)
    report = evaluation.evaluate_model(model, manifest, Task.REGRESSION, trivial=trivial)
    targets = np.concatenate([labels.numpy() for _, labels in input_pipeline.create_dataset(manifest, "eval", 64)])
    assert report.baseline_model == "train mean 0.25"
    assert report.baseline["rmse"] == pytest.approx(np.sqrt(np.mean((targets - 0.25) ** 2)), rel=1e-5)
    assert report.baseline["r2"] == pytest.approx(1 - np.mean((targets - 0.25) ** 2) / np.var(targets), rel=1e-5)
    assert set(report.baseline) == set(report.metrics)
    assert "| metric | value | trivial model |" in report.to_markdown()
    # `evaluation.metrics` picks what is reported, for the model and the trivial predictor alike, in its order.
    chosen = evaluation.evaluate_model(model, manifest, Task.REGRESSION, trivial=trivial, metrics=("rmse", "loss"))
    assert list(chosen.metrics) == list(chosen.baseline) == ["rmse", "loss"]
    assert chosen.metrics["rmse"] == report.metrics["rmse"]
