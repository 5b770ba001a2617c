"""Schema inference per format (CSV, Parquet, JSONL, NPZ), column selection, and the values written."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline_lib.config import DataConfig
from pipeline_lib.core import storage
from pipeline_lib.data.convert import convert
from pipeline_lib.data.errors import ConversionError
from pipeline_lib.data.manifest import SCHEMA_NAME, DType, FeatureSpec
from tests.pipeline_lib.data.conversion_support import (
    csv_with_bad_rows,
    make_rows,
    read_all,
    write_csv,
)


def test_csv_schema_inference_and_values(tmp_path):
    rows = make_rows(200)
    source = write_csv(tmp_path / "a.csv", rows)
    manifest = convert(DataConfig(source=source, label="y"), str(tmp_path / "out"))
    schema = manifest.feature_schema
    assert schema.features == (
        FeatureSpec(name="id", dtype=DType.INT64), FeatureSpec(name="x", dtype=DType.FLOAT32),
        FeatureSpec(name="n", dtype=DType.INT64), FeatureSpec(name="color", dtype=DType.STRING),
    )
    assert schema.label == FeatureSpec(name="y", dtype=DType.INT64)
    assert schema.num_classes == max(r["y"] for r in rows) + 1
    parsed = read_all(manifest)
    order = np.argsort(parsed["id"])
    assert parsed["id"][order].tolist() == list(range(200))
    np.testing.assert_array_equal(parsed["x"][order], np.array([r["x"] for r in rows], np.float32))
    assert parsed["n"][order].tolist() == [r["n"] for r in rows]
    assert [c.decode() for c in parsed["color"][order]] == [r["color"] for r in rows]  # "" and unicode kept
    assert parsed["y"][order].tolist() == [r["y"] for r in rows]
    saved = json.loads((tmp_path / "out" / "data" / manifest.fingerprint / SCHEMA_NAME).read_text())
    assert saved["label"]["name"] == "y"
    assert manifest.num_records("train") + manifest.num_records("eval") == 200
    assert manifest.dataset_uri == storage.join(str(tmp_path / "out"), "data", manifest.fingerprint)


def test_parquet_schema_inference_with_vectors(tmp_path):
    n = 50
    vectors = np.arange(n * 3, dtype=np.float32).reshape(n, 3) / 7
    table = pa.table({
        "i8": pa.array(np.arange(n) - 25, pa.int8()),
        "f64": pa.array(np.linspace(0, 1, n)),
        "s": pa.array([f"s{i}" for i in range(n)]),
        "vec": pa.array(list(vectors), pa.list_(pa.float32())),
        "ivec": pa.FixedSizeListArray.from_arrays(pa.array(np.arange(n * 2), pa.int64()), 2),
        "flag": pa.array([i % 2 == 0 for i in range(n)]),
        "label": pa.array([float(i) / 10 for i in range(n)]),  # float label: regression
    })
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=16)
    manifest = convert(DataConfig(source=str(tmp_path / "t.parquet"), label="label", read_chunk_rows=7),
                       str(tmp_path / "out"))
    specs = {f.name: (f.dtype, f.shape) for f in manifest.feature_schema.features}
    assert specs == {"i8": (DType.INT64, ()), "f64": (DType.FLOAT32, ()), "s": (DType.STRING, ()),
                     "vec": (DType.FLOAT32, (3,)), "ivec": (DType.INT64, (2,)), "flag": (DType.INT64, ())}
    assert manifest.feature_schema.label.dtype == DType.FLOAT32
    assert manifest.feature_schema.num_classes is None
    parsed = read_all(manifest)
    order = np.argsort(parsed["i8"])
    np.testing.assert_array_equal(parsed["vec"][order], vectors)
    np.testing.assert_array_equal(parsed["ivec"][order], np.arange(n * 2).reshape(n, 2))
    assert parsed["flag"][order].tolist() == [int(i % 2 == 0) for i in range(n)]


def test_jsonl_schema_inference_with_vectors_and_string_labels(tmp_path):
    path = tmp_path / "d.jsonl"
    labels = ["cat", "dog", "ant"]
    with open(path, "w") as handle:
        for i in range(60):
            handle.write(json.dumps({"k": i, "v": [i, i + 0.5], "iv": [i, -i, 7], "t": f"é{i}",
                                     "animal": labels[i % 3]}) + "\n")
            if i == 10:
                handle.write("\n")  # blank lines are skipped
    manifest = convert(DataConfig(source=str(path), label="animal", read_chunk_rows=16),
                       str(tmp_path / "out"))
    schema = manifest.feature_schema
    assert {f.name: (f.dtype, f.shape) for f in schema.features} == {
        "k": (DType.INT64, ()), "v": (DType.FLOAT32, (2,)), "iv": (DType.INT64, (3,)), "t": (DType.STRING, ())}
    assert schema.label_vocabulary == ("ant", "cat", "dog")
    assert schema.num_classes == 3 and schema.label.dtype == DType.INT64
    parsed = read_all(manifest)
    order = np.argsort(parsed["k"])
    assert parsed["animal"][order].tolist() == [sorted(labels).index(labels[i % 3]) for i in range(60)]
    np.testing.assert_array_equal(parsed["v"][order][:, 1], np.arange(60) + 0.5)


def test_npz_schema_inference_streams_each_array(tmp_path):
    n = 40
    images = np.random.default_rng(0).normal(size=(n, 5)).astype(np.float64)
    np.savez_compressed(tmp_path / "d.npz", image=images, count=np.arange(n, dtype=np.int32),
                        name=np.array([f"n{i}" for i in range(n)]), label=np.arange(n) % 4)
    manifest = convert(DataConfig(source=str(tmp_path / "d.npz"), label="label", read_chunk_rows=9),
                       str(tmp_path / "out"))
    schema = manifest.feature_schema
    assert {f.name: (f.dtype, f.shape) for f in schema.features} == {
        "image": (DType.FLOAT32, (5,)), "count": (DType.INT64, ()), "name": (DType.STRING, ())}
    assert schema.num_classes == 4
    parsed = read_all(manifest)
    order = np.argsort(parsed["count"])
    np.testing.assert_array_equal(parsed["image"][order], images.astype(np.float32))
    assert [v.decode() for v in parsed["name"][order]] == [f"n{i}" for i in range(n)]


def test_features_selection_and_unknown_columns(tmp_path):
    source = write_csv(tmp_path / "a.csv", make_rows(20))
    manifest = convert(DataConfig(source=source, label="y", features=("x", "color")),
                       str(tmp_path / "out"))
    assert manifest.feature_schema.feature_names == ("x", "color")
    with pytest.raises(ConversionError) as error:
        convert(DataConfig(source=source, label="y", features=("x", "colour")), str(tmp_path / "out"))
    assert "colour" in str(error.value) and "['id', 'x', 'n', 'color', 'y']" in str(error.value)
    with pytest.raises(ConversionError, match="data.label 'target' is not a column"):
        convert(DataConfig(source=source, label="target"), str(tmp_path / "out"))


def test_a_non_numeric_value_in_the_first_chunk_makes_the_column_a_string(tmp_path):
    source = csv_with_bad_rows(tmp_path / "bad.csv")
    manifest = convert(DataConfig(source=source, label="y", on_bad_record="skip", read_chunk_rows=100),
                       str(tmp_path / "out"))
    assert {f.name: f.dtype for f in manifest.feature_schema.features}["size"] == DType.STRING
    assert manifest.num_bad_records == 1  # only the row with too few fields
