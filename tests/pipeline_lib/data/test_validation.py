"""Tests for pipeline_lib.data.validation on the wine table: the anomalies a changed source shows; a label with one
value in the train split refused before training."""

from __future__ import annotations

import pytest

from pipeline_lib.config import DataConfig, Task, ValidationConfig
from pipeline_lib.core.exit_codes import EXIT_BAD_INPUT, exit_code_of
from pipeline_lib.data.convert import convert
from pipeline_lib.data.manifest import DType, FeatureSpec, Schema
from pipeline_lib.data.statistics import load_statistics
from pipeline_lib.data.validation import (
    DataValidationError,
    LabelError,
    check_label,
    jensen_shannon,
    validate_statistics,
)
from tests.pipeline_lib.data.wine_support import write_wine_csv


def _converted(root, name, **changes):
    source = write_wine_csv(root / f"{name}.csv", **changes)
    manifest = convert(DataConfig(source=source, label="cultivar"), str(root / "out"))
    return manifest.feature_schema, load_statistics(manifest)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    return _converted(tmp_path_factory.mktemp("wine_baseline"), "wine")


def _check(baseline, current, **config):
    return validate_statistics(*current, *baseline, ValidationConfig(**config), "the test's baseline")


def test_the_same_data_has_no_anomaly_and_another_sample_stays_below_the_thresholds(baseline, tmp_path):
    assert _check(baseline, baseline).anomalies == ()
    resampled = _converted(tmp_path, "other", seed=3)  # other missing cells and cellar noise, same table
    assert _check(baseline, resampled).anomalies == ()


def test_a_column_in_other_units_is_drift_named_with_observed_and_expected(baseline, tmp_path):
    report = _check(baseline, _converted(tmp_path, "scaled", scale={"proline": 3.0}))
    assert [a.name for a in report.blocking] == ["drift:proline"]
    [anomaly] = report.blocking
    assert "Jensen-Shannon divergence" in anomaly.observed and "validation.drift.jensen_shannon" in anomaly.expected
    assert "units" in anomaly.fix and "'drift:proline'" in anomaly.fix
    with pytest.raises(DataValidationError, match=r"drift:proline: observed Jensen-Shannon"):
        report.raise_if_blocking()
    allowed = _check(baseline, _converted(tmp_path, "scaled", scale={"proline": 3.0}), allow=("drift:proline",))
    assert allowed.blocking == () and allowed.anomalies[0].allowed
    allowed.raise_if_blocking()


def test_a_new_category_in_a_fifth_of_the_rows_is_reported(baseline, tmp_path):
    report = _check(baseline, _converted(tmp_path, "annex", new_category_share=0.2))
    names = {a.name for a in report.blocking}
    assert "unseen_values:cellar" in names and "drift:cellar" in names
    unseen = next(a for a in report.blocking if a.kind == "unseen_values")
    assert "'annex'" in unseen.observed
    share = float(unseen.observed.split("%")[0])
    assert 12 <= share <= 28
    assert _check(baseline, _converted(tmp_path, "annex", new_category_share=0.2),
                  allow=("unseen_values:*", "drift:cellar")).blocking == ()


def test_a_jump_in_missing_values_a_new_and_a_lost_column_and_a_type_change(baseline, tmp_path):
    report = _check(baseline, _converted(tmp_path, "holes", missing_rate=0.3))
    assert {a.kind for a in report.blocking} == {"missing_rate"}
    assert len(report.blocking) == 14  # every feature: 13 numbers and the cellar
    schema, statistics = baseline
    narrowed = DataConfig(source=str(tmp_path / "holes.csv"), label="cultivar",
                          features=tuple(f for f in schema.feature_names if f != "ash"))
    manifest = convert(narrowed, str(tmp_path / "narrow"))
    current = (manifest.feature_schema, load_statistics(manifest))
    assert {"missing_column:ash"} <= {a.name for a in _check(baseline, current).blocking}
    assert {"new_column:ash"} <= {a.name for a in _check(current, baseline).blocking}
    retyped = schema.model_copy(update={"features": tuple(
        f.model_copy(update={"dtype": DType.STRING}) if f.name == "hue" else f for f in schema.features)})
    assert [a.name for a in _check(baseline, (retyped, statistics)).blocking] == ["type_change:hue"]


def test_jensen_shannon_bounds():
    assert jensen_shannon([0.5, 0.5], [0.5, 0.5]) == 0
    assert jensen_shannon([1.0, 0.0], [0.0, 1.0]) == pytest.approx(1.0)


def _table(root, name: str, labels: list[str]):
    """A small CSV (one number, one label cell per row) converted: its schema and statistics."""
    lines = ["x,target", *(f"{i * 0.5},{label}" for i, label in enumerate(labels))]
    (root / f"{name}.csv").write_text("\n".join(lines) + "\n")
    manifest = convert(DataConfig(source=str(root / f"{name}.csv"), label="target"), str(root / name))
    return manifest.feature_schema, load_statistics(manifest)


def test_a_label_with_one_value_in_the_train_split_is_an_input_error_naming_it(baseline, tmp_path):
    check_label(*baseline, Task.CLASSIFICATION)  # three cultivars: fine
    # A string label, an integer label whose one value 7 makes the schema say 8 classes, a constant float label.
    for labels, task, shown in ((["yes"] * 40, Task.CLASSIFICATION, "'yes'"),
                                (["7"] * 40, Task.CLASSIFICATION, "7"),
                                (["2.5"] * 40, Task.REGRESSION, "2.5")):
        schema, statistics = _table(tmp_path, f"one_{shown.strip(chr(39)).replace('.', '_')}", labels)
        with pytest.raises(LabelError) as raised:
            check_label(schema, statistics, task)
        message = str(raised.value)
        train_rows = statistics.splits["train"].num_rows
        assert f"data.label 'target' has one value in the train split ({shown} on all {train_rows} rows)" in message
        assert ("at least two classes" if task == Task.CLASSIFICATION else "constant") in message, message
        assert "training did not start" in message and exit_code_of(raised.value) == EXIT_BAD_INPUT
    schema, statistics = _table(tmp_path, "two", ["1.5", "2.5"] * 20)
    check_label(schema, statistics, Task.REGRESSION)  # a float label that varies: fine
    # Without statistics the schema tells it: one class in the vocabulary.
    one_class = Schema(features=(FeatureSpec(name="x", dtype=DType.FLOAT32),),
                       label=FeatureSpec(name="target", dtype=DType.INT64), num_classes=1, label_vocabulary=("yes",))
    with pytest.raises(LabelError, match=r"has one value in the train split \('yes'\); a classifier"):
        check_label(one_class, None, Task.CLASSIFICATION)


def test_a_timestamp_column_of_newer_data_is_not_drift_but_its_missing_rate_and_type_are_checked(tmp_path):
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    def converted(name: str, start_year: int, missing_every: int = 0, text: bool = False):
        rng = np.random.default_rng(0)
        start = np.datetime64(f"{start_year}-01-01", "us").astype(np.int64)
        micros = start + rng.integers(0, 86_400_000_000 * 180, size=200)
        mask = (np.arange(200) % missing_every == 0) if missing_every else None
        at = (pa.array(micros.astype("datetime64[us]").astype(str).tolist(), mask=mask) if text
              else pa.array(micros, pa.timestamp("us", tz="UTC"), mask=mask))
        pq.write_table(pa.table({"at": at, "x": rng.normal(size=200), "y": np.arange(200) % 2}),
                       tmp_path / f"{name}.parquet")
        manifest = convert(DataConfig(source=str(tmp_path / f"{name}.parquet"), label="y"), str(tmp_path / name))
        return manifest.feature_schema, load_statistics(manifest)

    baseline = converted("old", 2020)
    assert _check(baseline, converted("new", 2024)).anomalies == ()  # four years on: every instant unseen
    assert [a.name for a in _check(baseline, converted("holes", 2024, missing_every=2)).blocking] == [
        "missing_rate:at"]
    retyped = _check(baseline, converted("text", 2020, text=True))
    assert [(a.name, a.observed, a.expected) for a in retyped.blocking] == [("type_change:at", "string", "timestamp")]
