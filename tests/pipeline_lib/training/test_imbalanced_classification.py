"""An imbalanced binary table it has never seen (10 % positives, mixed scales, a string column, missing cells) with
the smallest config: at least as accurate as a logistic regression on standardized features, and better than the
majority class the gate compares it with."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from pipeline_lib.config import parse_config
from pipeline_lib.data.convert import convert
from tests.pipeline_lib.data.conversion_support import read_all
from tests.pipeline_lib.training.test_label_scaling import _train_and_evaluate

NUMERIC = ("tenure", "charges", "latency", "balance")


def churn_table(num_rows: int = 1500, seed: int = 0) -> pd.DataFrame:
    """Churn-like rows: months (1-72), money (1e1-1e2), seconds (1e-3), a balance (1e4), a plan, 3 % missing cells,
    and a string label with about 10 % "churned"."""
    rng = np.random.default_rng(seed)
    frame = pd.DataFrame({
        "tenure": rng.integers(1, 73, num_rows).astype(float),
        "charges": rng.uniform(20, 120, num_rows),
        "latency": rng.lognormal(np.log(0.02), 0.5, num_rows),
        "balance": rng.normal(10_000, 4_000, num_rows),
        "plan": rng.choice(["basic", "plus", "pro"], num_rows, p=[0.5, 0.3, 0.2]),
    })
    logit = (-4.7 - 0.12 * (frame["tenure"] - 36) + 0.06 * (frame["charges"] - 70)
             + 60 * (frame["latency"] - 0.02) + frame["plan"].map({"basic": 1.0, "plus": 0.0, "pro": -1.2}))
    churned = rng.random(num_rows) < 1 / (1 + np.exp(-logit))
    for column in frame.columns:
        frame.loc[rng.random(num_rows) < 0.03, column] = None
    frame["status"] = np.where(churned, "churned", "stayed")
    return frame


def _labels(manifest, records) -> np.ndarray:
    """Class indices of the label, stored as the vocabulary's index (or, were it kept as text, its string)."""
    vocabulary = list(manifest.feature_schema.label_vocabulary)
    return np.asarray([vocabulary.index(v.decode()) if isinstance(v, bytes) else int(v)
                       for v in np.ravel(records["status"])])


def _logistic_accuracy(manifest) -> float:
    from sklearn.compose import make_column_transformer
    from sklearn.impute import SimpleImputer
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import OneHotEncoder, StandardScaler

    def frame(split):
        records = read_all(manifest, split)
        values = pd.DataFrame({name: records[name].astype(np.float64) for name in NUMERIC})
        values["plan"] = [v.decode() or "?" for v in records["plan"]]
        return values, _labels(manifest, records)

    (x_train, y_train), (x_eval, y_eval) = frame("train"), frame("eval")
    logistic = make_pipeline(
        make_column_transformer((make_pipeline(SimpleImputer(), StandardScaler()), list(NUMERIC)),
                                (OneHotEncoder(handle_unknown="ignore"), ["plan"])),
        LogisticRegression(max_iter=1000))
    logistic.fit(x_train, y_train)
    return float(np.mean(logistic.predict(x_eval) == y_eval))


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    root = tmp_path_factory.mktemp("churn_table")
    churn_table().to_csv(root / "table.csv", index=False)
    # The smallest config the README allows: the source and the label.
    config = parse_config({"data": {"source": str(root / "table.csv"), "label": "status"},
                           "output_root": str(root / "out")})
    return root, config, convert(config.data, config.output_root)


def test_the_smallest_config_is_at_least_as_accurate_as_a_standardized_logistic_regression(table):
    # Measured on seeds 0-2 of this table (10-14 % positives): accuracy 0.926/0.934/0.940 against the logistic
    # regression's 0.904/0.928/0.930 and the majority class's 0.862/0.900/0.879, with the same defaults as any table.
    root, config, manifest = table
    churned = list(manifest.feature_schema.label_vocabulary).index("churned")
    positives = np.mean(_labels(manifest, read_all(manifest, "train")) == churned)
    assert 0.05 < positives < 0.15  # imbalanced, as generated
    _export, report, decision = _train_and_evaluate(root, config, manifest, "default")
    logistic = _logistic_accuracy(manifest)
    assert report.metrics["accuracy"] >= logistic, (report.metrics, logistic)
    # The trivial model is the train split's majority class, "stayed"; the gate judges the model against it.
    assert "stayed" in report.baseline_model and report.baseline["accuracy"] < report.metrics["accuracy"]
    assert decision.blessed, decision.reason
