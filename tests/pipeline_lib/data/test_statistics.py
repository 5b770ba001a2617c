"""Tests for pipeline_lib.data.statistics and accumulators: the conversion pass's statistics equal numpy's and merge exactly."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest

from pipeline_lib.config import DataConfig
from pipeline_lib.core import storage
from pipeline_lib.data import accumulators
from pipeline_lib.data import statistics as stats_lib
from pipeline_lib.data.convert import convert
from pipeline_lib.data.manifest import MANIFEST_NAME
from pipeline_lib.data.statistics import STATISTICS_NAME, load_statistics
from tests.pipeline_lib.data.conversion_support import read_all
from tests.pipeline_lib.data.wine_support import (
    WINE_CLASSES,
    wine_frame,
    write_wine_csv,
)


@pytest.fixture(scope="module")
def wine(tmp_path_factory):
    root = tmp_path_factory.mktemp("wine_stats")
    source = write_wine_csv(root / "wine.csv", missing_rate=0.05)
    manifest = convert(DataConfig(source=source, label="cultivar", read_chunk_rows=50), str(root / "out"))
    return root, source, manifest


def test_statistics_json_sits_beside_the_manifest_and_its_hash_is_recorded(wine):
    _root, _source, manifest = wine
    fs, path = storage.get_fs(manifest.dataset_uri)
    payload = fs.cat_file(storage.join(path, STATISTICS_NAME))
    assert stats_lib.hashlib.sha256(payload).hexdigest() == manifest.statistics_sha256
    assert json.loads(fs.cat_file(storage.join(path, MANIFEST_NAME)))["statistics_sha256"] == manifest.statistics_sha256
    statistics = load_statistics(manifest)
    assert statistics.label == "cultivar" and set(statistics.splits) == {"train", "eval"}
    assert statistics.splits["train"].num_rows == manifest.num_records("train")


def test_numeric_statistics_equal_numpys_on_the_same_rows(wine):
    _root, _source, manifest = wine
    statistics = load_statistics(manifest)
    _values, _target, names = wine_frame()
    for split in ("train", "eval"):
        rows = read_all(manifest, split)
        for name in names:
            column = rows[name].astype(np.float64)
            present = column[~np.isnan(column)]
            numeric = statistics.feature(name, split).numeric
            assert numeric.missing == int(np.isnan(column).sum()), name
            assert numeric.count == len(present)
            assert numeric.min == pytest.approx(present.min()) and numeric.max == pytest.approx(present.max())
            assert numeric.mean == pytest.approx(present.mean(), rel=1e-9)
            assert numeric.variance == pytest.approx(present.var(), rel=1e-9)
            median = numeric.quantile(0.5)
            # The sketch's median is within a bucket (about 3 %, all values here are positive) of the rank median.
            assert np.mean(present <= median * 1.04) >= 0.5 >= np.mean(present < median * 0.96), name


def test_string_statistics_count_values_and_missing_cells(wine):
    _root, _source, manifest = wine
    statistics = load_statistics(manifest)
    rows = read_all(manifest, "train")
    cellar = [v.decode() for v in rows["cellar"].tolist()]
    string = statistics.feature("cellar").string
    assert string.missing == cellar.count("")
    assert string.values == {v: cellar.count(v) for v in set(cellar) - {""}}
    assert string.distinct == 3 and string.top(1)[0][1] == max(string.values.values())
    label = statistics.feature("cultivar").string  # the label as read: class names
    assert set(label.values) == set(WINE_CLASSES) and label.missing == 0


def test_statistics_merge_exactly_across_chunks_and_splits(wine, tmp_path):
    _root, source, manifest = wine
    one_chunk = convert(DataConfig(source=source, label="cultivar", read_chunk_rows=10_000), str(tmp_path / "o"))
    small, whole = load_statistics(manifest), load_statistics(one_chunk)
    for split in ("train", "eval"):
        for name, feature in small.splits[split].features.items():
            other = whole.splits[split].features[name]
            if feature.numeric is not None:
                assert feature.numeric.sketch == other.numeric.sketch
                assert (feature.numeric.count, feature.numeric.missing) == (other.numeric.count,
                                                                            other.numeric.missing)
                assert feature.numeric.mean == pytest.approx(other.numeric.mean, rel=1e-12)
                assert feature.numeric.variance == pytest.approx(other.numeric.variance, rel=1e-12)
            else:
                assert feature.string == other.string


def test_accumulator_handles_ints_vectors_negatives_and_missing_markers():
    accumulator = accumulators.NumericAccumulator()
    accumulator.add(np.array([3, -2, stats_lib.MISSING_INT64, 7], dtype=np.int64))
    accumulator.add(np.array([[1.5, np.nan], [-0.25, 4.0]], dtype=np.float32))
    result = accumulator.result()
    present = np.array([3, -2, 7, 1.5, -0.25, 4.0])
    assert (result.count, result.missing) == (6, 2)
    assert result.mean == pytest.approx(present.mean()) and result.variance == pytest.approx(present.var())
    assert sum(result.sketch.values()) == 6 and result.quantile(0.0) == -2 and result.quantile(1.0) == 7
    strings = accumulators.StringAccumulator()
    strings.add(pa.array([b"a", b"", b"b", b"a", None], pa.binary()))
    assert strings.result().values == {"a": 2, "b": 1} and strings.result().missing == 2


def test_a_high_cardinality_string_column_keeps_its_most_frequent_values(monkeypatch):
    monkeypatch.setattr(stats_lib, "MAX_TRACKED_VALUES", 5)
    strings = accumulators.StringAccumulator()
    strings.add(pa.array([b"a", b"a", b"b", b"c", b"d", b"e", b"f", b"", None], pa.binary()))
    strings.add(pa.array([b"a", b"z", b"b", b""], pa.binary()))  # after the cut: only tracked values are counted
    result = strings.result()
    assert result.truncated and (result.count, result.missing) == (10, 3)
    assert result.values == {"a": 3, "b": 2, "c": 1, "d": 1, "e": 1}


def test_statistics_of_parts_merge_into_those_of_the_whole():
    """What the Ray engine's driver does with its tasks' statistics: counts, extremes, sketches and string counts
    exactly, the moments up to rounding, and the most frequent strings when a part or the sum is cut."""
    rng = np.random.default_rng(3)
    x = rng.normal(10, 3, 3000).astype(np.float32)
    x[rng.random(3000) < 0.05] = np.nan
    colors = pa.array([rng.choice([b"red", b"blue", b"", b"green"]) for _ in range(3000)], pa.binary())
    to_eval = rng.random(3000) < 0.25

    def statistics_of(rows: slice) -> stats_lib.DatasetStatistics:
        builder = accumulators.StatisticsBuilder({"x": stats_lib.DType.FLOAT32, "color": stats_lib.DType.STRING},
                                                 ["train", "eval"])
        builder.add_chunk({"x": x[rows], "color": colors[rows]}, to_eval[rows], int(to_eval[rows].sum()))
        return builder.result("color")

    whole = statistics_of(slice(0, 3000))
    merged = stats_lib.merge_statistics([statistics_of(slice(0, 700)), statistics_of(slice(700, 701)),
                                         statistics_of(slice(701, 3000))])
    for split in ("train", "eval"):
        assert merged.splits[split].num_rows == whole.splits[split].num_rows
        got, want = merged.feature("x", split).numeric, whole.feature("x", split).numeric
        assert (got.count, got.missing, got.min, got.max, got.sketch) == (
            want.count, want.missing, want.min, want.max, want.sketch)
        assert got.mean == pytest.approx(want.mean, rel=1e-12) and got.variance == pytest.approx(want.variance,
                                                                                                   rel=1e-9)
        assert merged.feature("color", split).string == whole.feature("color", split).string

    many = [stats_lib.StringStatistics(count=1, missing=0, values={f"v{i:05d}": 1})
            for i in range(stats_lib.MAX_TRACKED_VALUES + 1)]
    cut = stats_lib._merge_string(many)
    assert cut.truncated and cut.count == len(many) and len(cut.values) == stats_lib.MAX_TRACKED_VALUES
