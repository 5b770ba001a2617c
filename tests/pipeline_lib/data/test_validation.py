"""Tests for pipeline_lib.data.validation on the wine table: the anomalies a changed source shows."""

from __future__ import annotations

import pytest

from pipeline_lib.config import DataConfig, ValidationConfig
from pipeline_lib.data.convert import convert
from pipeline_lib.data.manifest import DType
from pipeline_lib.data.statistics import load_statistics
from pipeline_lib.data.validation import (
    DataValidationError,
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
