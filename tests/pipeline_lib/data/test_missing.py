"""Tests for pipeline_lib.data.missing: impute (the default), skip and fail, per column; the fill values."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline_lib.config import ConfigError, DataConfig, parse_config
from pipeline_lib.data.convert import convert
from pipeline_lib.data.errors import ConversionError
from pipeline_lib.data.statistics import MISSING_INT64, load_statistics
from pipeline_lib.training import input_pipeline
from pipeline_lib.training.preprocessing import Impute, numeric_constants
from tests.pipeline_lib.data.conversion_support import read_all

ROWS = ["id,count,size,color,y",
        "1,3,1.5,red,0", "2,,2.5,blue,1", "3,5,,red,0", "4,7,4.5,,1", "5,9,10.0,green,0", "6,11,,blue,1"]


@pytest.fixture
def source(tmp_path):
    path = tmp_path / "holes.csv"
    path.write_text("\n".join(ROWS) + "\n")
    return str(path)


def _everything(manifest):
    rows = {k: np.concatenate([read_all(manifest, "train")[k], read_all(manifest, "eval")[k]])
            for k in ("id", "count", "size", "color")}
    order = np.argsort(rows["id"])
    return {k: v[order] for k, v in rows.items()}


def test_by_default_missing_features_are_written_missing_and_counted(source, tmp_path):
    manifest = convert(DataConfig(source=source, label="y"), str(tmp_path / "out"))
    assert manifest.num_bad_records == 0
    rows = _everything(manifest)
    assert rows["count"].tolist() == [3, MISSING_INT64, 5, 7, 9, 11]
    assert np.isnan(rows["size"]).tolist() == [False, False, True, False, False, True]
    assert rows["color"].tolist() == [b"red", b"blue", b"red", b"", b"green", b"blue"]
    merged = {name: sum(load_statistics(manifest).feature(name, split).missing for split in ("train", "eval"))
              for name in ("count", "size", "color")}
    assert merged == {"count": 1, "size": 2, "color": 1}
    # The input pipeline gives the model NaN for a missing int64 as for a missing float.
    numeric = np.concatenate([inputs["numeric"].numpy() for inputs, _ in
                              input_pipeline.create_dataset(manifest, "train", 8)]
                             + [inputs["numeric"].numpy() for inputs, _ in
                                input_pipeline.create_dataset(manifest, "eval", 8)])
    assert int(np.isnan(numeric).sum()) == 3


def test_fill_values_come_from_the_train_split_as_configured_per_column(source, tmp_path):
    data = DataConfig(source=source, label="y", split={"eval_fraction": 0.01},  # every row in train
                      missing_columns={"size": {"impute_with": "median", "missing_indicator": True},
                                       "id": {"impute_with": "constant", "impute_value": -1}})
    manifest = convert(data, str(tmp_path / "out"))
    assert manifest.num_records("eval") == 0
    imputation = load_statistics(manifest).imputation
    assert imputation["count"].fill_value == pytest.approx(np.mean([3, 5, 7, 9, 11]))
    assert not imputation["count"].indicator
    # The lower median of 1.5, 2.5, 4.5 and 10.0, within a sketch bucket.
    assert imputation["size"].fill_value == pytest.approx(2.5, rel=0.04) and imputation["size"].indicator
    assert imputation["id"].fill_value == -1
    assert "color" not in imputation  # strings: out-of-vocabulary in the model


def test_skip_and_fail_per_column(source, tmp_path):
    skip_size = DataConfig(source=source, label="y", missing_columns={"size": {"missing": "skip"}})
    manifest = convert(skip_size, str(tmp_path / "skip"))
    assert manifest.num_bad_records == 2  # the rows without a size; the others are imputed
    assert sorted(_everything(manifest)["id"].tolist()) == [1, 2, 4, 5]
    with pytest.raises(ConversionError) as error:
        convert(DataConfig(source=source, label="y", missing="fail"), str(tmp_path / "fail"))
    message = str(error.value)
    assert "holes.csv line 3, column 'count'" in message and "is missing" in message
    assert "data.missing" in message
    with pytest.raises(ConversionError, match=r"line 5, column 'color'"):  # an empty string is missing too
        convert(DataConfig(source=source, label="y", missing_columns={"color": {"missing": "fail"}}),
                str(tmp_path / "fail-color"))


def test_missing_columns_must_name_features(source, tmp_path):
    with pytest.raises(ConversionError, match=r"data.missing_columns names \['colour'\]"):
        convert(DataConfig(source=source, label="y", missing_columns={"colour": {"missing": "skip"}}),
                str(tmp_path / "out"))
    with pytest.raises(ConfigError, match=r"missing_columns names the label 'y'"):
        parse_config({"data": {"source": source, "label": "y", "missing_columns": {"y": {"missing": "skip"}}}})


def test_a_missing_label_in_a_row_skipped_for_a_missing_feature_still_fails(tmp_path):
    path = tmp_path / "both.csv"
    path.write_text("a,b,y\n1.0,2.0,0\n,3.0,\n4.0,5.0,1\n")
    with pytest.raises(ConversionError, match=r"both.csv line 3, column"):
        convert(DataConfig(source=str(path), label="y", missing="skip"), str(tmp_path / "out"))
    manifest = convert(DataConfig(source=str(path), label="y", missing="skip", on_bad_record="skip"),
                       str(tmp_path / "skip"))
    assert manifest.num_bad_records == 1


# --- NaN already in the source: missing, like an empty CSV cell ------------------------------------------------

NUM_NAN_ROWS = 600


def _columns_with_nan(float_label: bool = False) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(4)
    a = rng.normal(5.0, 2.0, size=NUM_NAN_ROWS).astype(np.float32)
    a[10:][rng.random(NUM_NAN_ROWS - 10) < 0.1] = np.nan
    b = rng.uniform(0.0, 1000.0, size=NUM_NAN_ROWS).astype(np.float32)
    b[[3, 17]] = np.nan  # row 4 (1-based) holds the first NaN of the file
    y = rng.integers(0, 2, size=NUM_NAN_ROWS)
    label = y.astype(np.float32) if float_label else y
    if float_label:
        label[[5, 9]] = np.nan
    return {"id": np.arange(NUM_NAN_ROWS), "a": a, "b": b, "y": label}


def _write_source(tmp_path, fmt: str, columns: dict[str, np.ndarray]) -> str:
    path = tmp_path / f"holes.{fmt}"
    if fmt == "parquet":
        pq.write_table(pa.table(columns), path)
    elif fmt == "npz":
        np.savez(path, **columns)
    else:  # JSON lines: Python's json writes a float NaN as NaN, and reads it back so
        rows = [{k: v[i].item() for k, v in columns.items()} for i in range(NUM_NAN_ROWS)]
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


@pytest.mark.parametrize("fmt", ["parquet", "npz", "jsonl"])
def test_nan_in_the_source_is_missing_counted_and_imputed_with_the_train_mean(tmp_path, fmt):
    columns = _columns_with_nan()
    source = _write_source(tmp_path, fmt, columns)
    manifest = convert(DataConfig(source=source, label="y", read_chunk_rows=128, missing_indicator=True),
                       str(tmp_path / "out"))
    assert manifest.num_bad_records == 0
    assert manifest.num_records("train") + manifest.num_records("eval") == NUM_NAN_ROWS
    statistics = load_statistics(manifest)
    written = {split: read_all(manifest, split) for split in ("train", "eval")}
    for name in ("a", "b"):
        for split, rows in written.items():
            numeric = statistics.feature(name, split).numeric
            assert numeric.missing == int(np.isnan(rows[name]).sum()), (name, split)
            assert numeric.count == int((~np.isnan(rows[name])).sum())
        # The written tf.train.Examples hold NaN (the missing form) in exactly the source's NaN cells.
        ids = np.concatenate([rows["id"][np.isnan(rows[name])] for rows in written.values()])
        assert sorted(ids.tolist()) == np.flatnonzero(np.isnan(columns[name])).tolist()
        train_mean = np.nanmean(written["train"][name].astype(np.float64))
        assert statistics.imputation[name].fill_value == pytest.approx(train_mean, rel=1e-9)
        assert statistics.imputation[name].indicator
    # The model's imputation, built from these statistics, fills each of them with the train mean.
    specs = input_pipeline.numeric_features(manifest.feature_schema)
    fills = numeric_constants(manifest.feature_schema, statistics)[0]
    train = written["train"]
    x = np.stack([train[spec.name].astype(np.float32) for spec in specs], axis=1)
    imputed = np.asarray(Impute(fills)(x))
    for j, spec in enumerate(specs):
        holes = np.isnan(x[:, j])
        if spec.name in ("a", "b"):
            assert holes.any()
            assert np.allclose(imputed[holes, j], np.nanmean(x[:, j].astype(np.float64)), rtol=1e-6)
        assert np.array_equal(imputed[~holes, j], x[~holes, j])


@pytest.mark.parametrize("fmt", ["parquet", "npz", "jsonl"])
def test_nan_in_the_source_fails_or_is_skipped_as_data_missing_says(tmp_path, fmt):
    source = _write_source(tmp_path, fmt, _columns_with_nan())
    with pytest.raises(ConversionError) as error:
        convert(DataConfig(source=source, label="y", missing="fail"), str(tmp_path / "fail"))
    message = str(error.value)
    unit = "line" if fmt == "jsonl" else "row"
    assert f"holes.{fmt} {unit} 4, column 'b': value nan is missing" in message and "data.missing" in message
    manifest = convert(DataConfig(source=source, label="y", missing_columns={"b": {"missing": "skip"}}),
                       str(tmp_path / "skip"))
    assert manifest.num_bad_records == 2
    kept = np.concatenate([read_all(manifest, split)["id"] for split in ("train", "eval")])
    assert sorted(set(range(NUM_NAN_ROWS)) - set(kept.tolist())) == [3, 17]
    statistics = load_statistics(manifest)
    assert sum(statistics.feature("b", split).missing for split in ("train", "eval")) == 0
    kept_a = np.delete(_columns_with_nan()["a"], [3, 17])  # a's NaN in the other rows: imputed (the default)
    assert sum(statistics.feature("a", split).missing for split in ("train", "eval")) == int(np.isnan(kept_a).sum())


@pytest.mark.parametrize("fmt", ["parquet", "npz"])
def test_a_nan_label_is_never_imputed(tmp_path, fmt):
    source = _write_source(tmp_path, fmt, _columns_with_nan(float_label=True))
    with pytest.raises(ConversionError, match=rf"holes.{fmt} row 6, column 'y': value nan is missing"):
        convert(DataConfig(source=source, label="y"), str(tmp_path / "fail"))
    manifest = convert(DataConfig(source=source, label="y", on_bad_record="skip"), str(tmp_path / "skip"))
    assert manifest.num_bad_records == 2
    labels = np.concatenate([read_all(manifest, split)["y"] for split in ("train", "eval")])
    assert len(labels) == NUM_NAN_ROWS - 2 and not np.isnan(labels).any()
    statistics = load_statistics(manifest)
    assert "y" not in statistics.imputation
    assert sum(statistics.feature("y", split).missing for split in ("train", "eval")) == 0


# --- NaN elements of a float vector column --------------------------------------------------------------------

def _vector_columns() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    v = rng.normal(10.0, 3.0, size=(NUM_NAN_ROWS, 4)).astype(np.float32)
    v[5, 1] = v[40, 3] = v[41, 0] = v[41, 2] = np.nan  # rows 6, 41 and 42 (1-based): some elements missing
    return {"id": np.arange(NUM_NAN_ROWS), "v": v, "y": rng.integers(0, 2, size=NUM_NAN_ROWS)}


def _write_vector_source(tmp_path, fmt: str, columns: dict[str, np.ndarray]) -> str:
    path = tmp_path / f"vectors.{fmt}"
    if fmt == "parquet":
        vectors = pa.FixedSizeListArray.from_arrays(pa.array(columns["v"].reshape(-1)), columns["v"].shape[1])
        pq.write_table(pa.table({"id": columns["id"], "v": vectors, "y": columns["y"]}), path)
    else:
        np.savez(path, **columns)
    return str(path)


@pytest.mark.parametrize("fmt", ["parquet", "npz"])
def test_nan_elements_of_a_vector_are_imputed_element_by_element_by_default(tmp_path, fmt):
    columns = _vector_columns()
    manifest = convert(DataConfig(source=_write_vector_source(tmp_path, fmt, columns), label="y",
                                  read_chunk_rows=128), str(tmp_path / "out"))
    assert manifest.num_bad_records == 0
    written = {split: read_all(manifest, split) for split in ("train", "eval")}
    statistics = load_statistics(manifest)
    for split, rows in written.items():
        vectors = np.stack(rows["v"]).astype(np.float32)
        assert statistics.feature("v", split).numeric.missing == int(np.isnan(vectors).sum())
        # Written as the source holds them: the NaN elements only, the row's other elements kept.
        assert np.array_equal(vectors, columns["v"][rows["id"]], equal_nan=True)
    # The model's numeric matrix: each feature's columns in schema order, the vector's four among them.
    specs = input_pipeline.numeric_features(manifest.feature_schema)
    rows = written["train"]
    x = np.concatenate([np.stack(rows[spec.name]).reshape(len(rows["id"]), -1).astype(np.float32)
                        for spec in specs], axis=1)
    imputed = np.asarray(Impute(numeric_constants(manifest.feature_schema, statistics)[0])(x))
    train = np.stack(rows["v"]).astype(np.float32)
    start = [spec.name for spec in specs].index("v")  # id (one column) comes first
    vector = imputed[:, start:start + 4]
    holes = np.isnan(train)
    assert holes.any() and not np.isnan(imputed).any()
    assert np.allclose(vector[holes], np.nanmean(train.astype(np.float64)), rtol=1e-6)
    assert np.array_equal(vector[~holes], train[~holes])


@pytest.mark.parametrize("fmt", ["parquet", "npz"])
def test_a_vector_with_a_nan_element_fails_or_is_skipped_as_data_missing_says(tmp_path, fmt):
    source = _write_vector_source(tmp_path, fmt, _vector_columns())
    with pytest.raises(ConversionError, match=rf"vectors.{fmt} row 6, column 'v': .* is missing.*data.missing"):
        convert(DataConfig(source=source, label="y", missing="fail"), str(tmp_path / "fail"))
    manifest = convert(DataConfig(source=source, label="y", missing="skip"), str(tmp_path / "skip"))
    assert manifest.num_bad_records == 3
    kept = np.concatenate([read_all(manifest, split)["id"] for split in ("train", "eval")])
    assert sorted(set(range(NUM_NAN_ROWS)) - set(kept.tolist())) == [5, 40, 41]
