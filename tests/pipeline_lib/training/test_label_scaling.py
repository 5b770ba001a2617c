"""A regression on a table it has never seen, with the smallest config: the label scaled like the features (the
model starts at the train mean and outputs the label's units), within 10 % of a standardized RidgeCV, and a model
that does not beat the train mean is refused by the gate."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from pipeline_lib.config import parse_config
from pipeline_lib.data.convert import convert
from pipeline_lib.data.statistics import load_statistics
from pipeline_lib.evaluation import consolidation
from pipeline_lib.evaluation import metrics as evaluation
from pipeline_lib.evaluation.gate import apply_gate
from pipeline_lib.planning import sharding
from pipeline_lib.serving.tfdag_scoring import Scorer
from pipeline_lib.training import input_pipeline, models
from pipeline_lib.training import loop as training
from tests.pipeline_lib.data.conversion_support import read_all

NUMERIC = ("age", "pressure", "dose", "income", "ratio")


def regression_table(num_rows: int = 400, seed: int = 0, noise: float = 700.0) -> pd.DataFrame:
    """A table that looks real: a target in the thousands, features in years, mm Hg, grams (1e-3), money (1e4) and a
    ratio (1e-2), a string column, and 3 % of the feature cells missing.

    The noise gives the signal-to-noise of the issue's table (a ridge regression's RMSE about 0.7 of the train
    mean's). With less of it (noise 300: the ridge at 0.43 of the mean) the default MLP's best checkpoint measured
    1.10-1.12 x the ridge's RMSE: on 320 rows of a linear table, the MLP's own variance, not the label's scale."""
    rng = np.random.default_rng(seed)
    frame = pd.DataFrame({
        "age": rng.uniform(20, 80, num_rows),
        "pressure": rng.normal(95, 14, num_rows),
        "dose": rng.lognormal(np.log(0.004), 0.4, num_rows),
        "income": rng.normal(52_000, 15_000, num_rows),
        "ratio": rng.uniform(0.01, 0.09, num_rows),
        "region": rng.choice(["north", "south", "east", "west"], num_rows),
    })
    effect = frame["region"].map({"north": 0.0, "south": 350.0, "east": -200.0, "west": 120.0})
    target = (2500 + 22 * (frame["age"] - 50) + 14 * (frame["pressure"] - 95) + 180_000 * (frame["dose"] - 0.004)
              + 0.018 * (frame["income"] - 52_000) + 9000 * (frame["ratio"] - 0.05) + effect
              + rng.normal(0, noise, num_rows))
    for column in frame.columns:
        frame.loc[rng.random(num_rows) < 0.03, column] = None
    frame["target"] = target.round(1)
    return frame


def _config(root, **extra):
    # The smallest config the README allows, and where it writes.
    return parse_config({"data": {"source": str(root / "table.csv"), "label": "target"},
                         "model": {"task": "regression"}, "output_root": str(root / "out"), **extra})


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    root = tmp_path_factory.mktemp("regression_table")
    regression_table().to_csv(root / "table.csv", index=False)
    config = _config(root)
    return root, config, convert(config.data, config.output_root)


def _train_and_evaluate(root, config, manifest, name):
    plan = sharding.plan_for_train(manifest, config.train, 1)
    result = training.train(config, manifest, plan, str(root / name))
    export = consolidation.consolidate(config, manifest, result, str(root / name / "export"))
    report = evaluation.evaluate(config, manifest, export.keras_path)
    return export, report, apply_gate(report, config.evaluation.gate)


def _ridge_rmse(manifest) -> float:
    from sklearn.compose import make_column_transformer
    from sklearn.impute import SimpleImputer
    from sklearn.linear_model import RidgeCV
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import OneHotEncoder, StandardScaler

    def frame(split):
        records = read_all(manifest, split)
        values = pd.DataFrame({name: records[name].astype(np.float64) for name in NUMERIC})
        values["region"] = [v.decode() or "?" for v in records["region"]]
        return values, records["target"].astype(np.float64)

    (x_train, y_train), (x_eval, y_eval) = frame("train"), frame("eval")
    ridge = make_pipeline(
        make_column_transformer((make_pipeline(SimpleImputer(), StandardScaler()), list(NUMERIC)),
                                (OneHotEncoder(handle_unknown="ignore"), ["region"])),
        RidgeCV(alphas=np.logspace(-3, 3, 13)))
    ridge.fit(x_train, y_train)
    return float(np.sqrt(np.mean((ridge.predict(x_eval) - y_eval) ** 2)))


def test_the_defaults_follow_the_task_and_the_label_statistics_are_the_train_splits(table):
    _root, config, manifest = table
    assert config.evaluation.metrics == ("loss", "mae", "rmse", "r2")
    assert config.evaluation.gate.metric == "rmse" and config.evaluation.gate.beat_baseline
    label = load_statistics(manifest).feature("target", "train").numeric
    targets = read_all(manifest, "train")["target"].astype(np.float64)
    assert label.mean == pytest.approx(targets.mean(), rel=1e-6)
    assert label.variance == pytest.approx(targets.var(), rel=1e-5)


def test_the_head_starts_at_the_train_mean_and_outputs_the_labels_units(table):
    _root, config, manifest = table
    statistics = load_statistics(manifest)
    label = statistics.feature("target", "train").numeric
    model = models.create_model(config.model, manifest.feature_schema, statistics)
    inputs, _ = next(iter(input_pipeline.create_dataset(manifest, "eval", 64)))
    initial = np.asarray(model(inputs)).reshape(-1)
    # Initial predictions spread on the label's scale around its mean, not around 0.
    assert abs(initial.mean() - label.mean) < 2 * np.sqrt(label.variance)
    head = model.get_layer("logits")
    kernel, bias = head.get_weights()
    assert not bias.any()  # the bias starts at 0 in z-space: at the train mean
    head.set_weights([np.zeros_like(kernel), bias])
    np.testing.assert_allclose(np.asarray(model(inputs)).reshape(-1), label.mean, rtol=1e-6)
    # The exported Keras model maps z-scores to the label with a standard layer: std * z + mean.
    rescaling = model.get_layer("label_units")
    assert type(rescaling).__module__.startswith("keras.")
    assert rescaling.get_config()["offset"] == pytest.approx(label.mean)
    assert rescaling.get_config()["scale"] == pytest.approx(np.sqrt(label.variance))
    # Opting out keeps a plain Dense head: outputs around 0, not the label's thousands.
    plain = models.create_model(config.model.model_copy(update={"params": {"scale_label": False}}),
                                manifest.feature_schema, statistics)
    assert np.abs(np.asarray(plain(inputs))).max() < 0.1 * label.mean


def test_the_smallest_config_lands_within_ten_percent_of_a_standardized_ridge(table):
    # The default training (early stopping under the 100-epoch ceiling: ~700 steps of 32 rows, 4-10 s): the claim
    # is accuracy, so the model trains as the defaults say. Seeds 0-3 of this table measured 0.97-1.02 x the ridge.
    root, config, manifest = table
    export, report, decision = _train_and_evaluate(root, config, manifest, "full")
    ridge = _ridge_rmse(manifest)
    assert report.metrics["rmse"] <= 1.10 * ridge, (report.metrics, ridge)
    assert export.selected_by == "best eval_rmse (min)"
    assert report.baseline_model.startswith("train mean") and report.baseline["rmse"] > 1.2 * report.metrics["rmse"]
    assert decision.blessed and decision.baseline_value == report.baseline["rmse"]
    assert "beats the trivial model" in decision.reason
    # The SavedModel serves the label's own units on raw rows, as the Keras model scored them.
    rows = regression_table().drop(columns="target").head(3)
    predicted = Scorer(export.saved_model_dir).predict(rows)["prediction"].to_numpy()
    assert 1000 < predicted.min() and predicted.max() < 5000


def test_a_model_that_does_not_beat_the_train_mean_is_not_blessed(table):
    root, _config_default, manifest = table
    config = _config(root, train={"steps": 1})
    _export, report, decision = _train_and_evaluate(root, config, manifest, "one_step")
    assert not decision.blessed
    assert decision.reason.startswith("does not beat the trivial model: rmse ")
    assert f"{report.baseline['rmse']:.4f}" in decision.reason and f"{report.metrics['rmse']:.4f}" in decision.reason
    # With the baseline check off, the same model is blessed: nothing else stands in its way.
    lenient = config.evaluation.gate.model_copy(update={"beat_baseline": False})
    assert apply_gate(report, lenient).blessed
