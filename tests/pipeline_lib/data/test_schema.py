"""Schema inference per format (CSV, Parquet, JSONL, NPZ), column selection, and the values written."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline_lib.config import DataConfig, OnBadRecord
from pipeline_lib.core import storage
from pipeline_lib.data.convert import convert
from pipeline_lib.data.errors import ConversionError
from pipeline_lib.data.manifest import SCHEMA_NAME, DType, FeatureSpec, TimeKind
from pipeline_lib.data.statistics import MISSING_INT64, load_statistics
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


# --- Arrow and Parquet logical types, dates and timestamps -------------------------------------------------------

MICROS_PER_DAY = 86_400_000_000


def _typed_parquet(path, n: int = 60) -> tuple[pa.Table, np.ndarray]:
    """Every Arrow type that becomes a feature, from instants before and after 1970 (with nulls)."""
    import decimal

    rng = np.random.default_rng(3)
    micros = rng.integers(-3_000_000_000_000_000, 4_000_000_000_000_000, size=n)
    micros[:3] = [-1, 0, 951_782_400_000_000]  # just before the epoch, the epoch, 2000-02-29 (a leap day)
    nulls = np.arange(n) % 7 == 5
    table = pa.table({
        "id": pa.array(np.arange(n)),
        "ts_us": pa.array(micros, pa.timestamp("us"), mask=nulls),
        "ts_tz": pa.array(micros, pa.timestamp("us", tz="America/New_York")),
        "ts_ns": pa.array(micros * 1000 + 999, pa.timestamp("ns")),
        "ts_ms": pa.array(micros // 1000, pa.timestamp("ms", tz="UTC")),
        "d32": pa.array((micros // MICROS_PER_DAY).astype(np.int32), pa.date32()),
        "d64": pa.array(micros // MICROS_PER_DAY * 86_400_000, pa.date64()),
        "dict_s": pa.array([["red", "green", None][i % 3] for i in range(n)]).dictionary_encode(),
        "dict_i": pa.array([i % 4 for i in range(n)], pa.int16()).dictionary_encode(),
        "dec": pa.array([decimal.Decimal(i) / 4 for i in range(n)], pa.decimal128(9, 2)),
        "flag": pa.array([i % 3 == 0 for i in range(n)]),
        "maybe": pa.array([None if i % 5 == 0 else i for i in range(n)], pa.int32()),
        "big": pa.array([f"é{i}" for i in range(n)], pa.large_string()),
        "y": pa.array(np.arange(n) % 2),
    })
    pq.write_table(table, path, row_group_size=25)
    return table, micros


def test_parquet_logical_types_become_features_and_instants_read_back_as_pyarrow_has_them(tmp_path):
    table, micros = _typed_parquet(tmp_path / "t.parquet")
    manifest = convert(DataConfig(source=str(tmp_path / "t.parquet"), label="y", read_chunk_rows=16),
                       str(tmp_path / "out"))
    specs = {f.name: f for f in manifest.feature_schema.features}
    assert {n: (s.dtype, s.time) for n, s in specs.items()} == {
        "id": (DType.INT64, None), "ts_us": (DType.INT64, TimeKind.TIMESTAMP),
        "ts_tz": (DType.INT64, TimeKind.TIMESTAMP), "ts_ns": (DType.INT64, TimeKind.TIMESTAMP),
        "ts_ms": (DType.INT64, TimeKind.TIMESTAMP), "d32": (DType.INT64, TimeKind.DATE),
        "d64": (DType.INT64, TimeKind.DATE), "dict_s": (DType.STRING, None), "dict_i": (DType.INT64, None),
        "dec": (DType.FLOAT32, None), "flag": (DType.INT64, None), "maybe": (DType.INT64, None),
        "big": (DType.STRING, None)}
    assert specs["ts_tz"].source_type == "timestamp[us, tz=America/New_York]"
    assert specs["ts_ns"].source_type == "timestamp[ns]" and specs["d32"].source_type == "date32[day]"
    parsed = read_all(manifest)
    order = np.argsort(parsed["id"])
    got = {name: parsed[name][order] for name in parsed}
    nulls = table.column("ts_us").is_null().to_numpy(zero_copy_only=False)
    # Timestamps: microseconds since 1970 UTC, whatever the unit or zone (ns floored); dates: days.
    assert got["ts_us"][~nulls].tolist() == micros[~nulls].tolist()
    assert (got["ts_us"][nulls] == MISSING_INT64).all()  # a null imputes: the model fills it in
    assert got["ts_tz"].tolist() == table.column("ts_tz").cast(pa.int64()).to_pylist() == micros.tolist()
    assert got["ts_ns"].tolist() == micros.tolist()
    assert got["ts_ms"].tolist() == (micros // 1000 * 1000).tolist()
    assert got["d32"].tolist() == table.column("d32").cast(pa.int32()).to_pylist() == (micros // MICROS_PER_DAY).tolist()
    assert got["d64"].tolist() == (micros // MICROS_PER_DAY).tolist()
    assert [v.decode() for v in got["dict_s"]] == [["red", "green", ""][i % 3] for i in range(60)]
    assert got["dict_i"].tolist() == [i % 4 for i in range(60)]
    np.testing.assert_array_equal(got["dec"], np.arange(60, dtype=np.float32) / 4)
    assert got["flag"].tolist() == [int(i % 3 == 0) for i in range(60)]
    assert got["maybe"].tolist() == [MISSING_INT64 if i % 5 == 0 else i for i in range(60)]
    stats = load_statistics(manifest).feature("ts_ns").numeric  # float64 moments of microseconds: finite
    assert stats.count == manifest.num_records("train")
    assert all(np.isfinite([stats.mean, stats.variance, stats.min, stats.max])) and stats.variance > 0
    assert micros.min() <= stats.min and stats.max <= micros.max()


def test_a_schema_without_time_columns_dumps_as_before_and_an_old_manifest_schema_loads():
    plain = FeatureSpec(name="x", dtype=DType.FLOAT32)
    assert plain.model_dump(mode="json") == {"name": "x", "dtype": "float32", "shape": []}
    assert FeatureSpec.model_validate_json('{"name": "x", "dtype": "int64", "shape": []}').time is None
    timed = FeatureSpec(name="t", dtype=DType.INT64, time=TimeKind.DATE, source_type="date32[day]")
    assert FeatureSpec.model_validate_json(timed.model_dump_json()) == timed


@pytest.mark.parametrize(("column", "shown"), [
    (pa.array([{"a": 1, "b": "x"}] * 4), "struct<a: int64, b: string>"),
    (pa.array([[("k", 1)]] * 4, pa.map_(pa.string(), pa.int64())), "map<string, int64"),
    (pa.array([[[1.0], [2.0]]] * 4), "list<element: list<element: double>>"),
    (pa.array([["a", "b"]] * 4), "list<element: string>"),
])
def test_a_nested_column_is_refused_naming_it_its_type_and_how_to_leave_it_out(tmp_path, column, shown):
    pq.write_table(pa.table({"nested": column, "x": [1.0, 2.0, 3.0, 4.0], "y": [0, 1, 0, 1]}), tmp_path / "n.parquet")
    with pytest.raises(ConversionError) as error:
        convert(DataConfig(source=str(tmp_path / "n.parquet"), label="y"), str(tmp_path / "out"))
    message = str(error.value)
    assert "'nested'" in message and shown in message and "data.features" in message
    manifest = convert(DataConfig(source=str(tmp_path / "n.parquet"), label="y", features=("x",)),
                       str(tmp_path / "out"))
    assert manifest.feature_schema.feature_names == ("x",)


def _instant(text: str) -> int:
    import datetime

    moment = datetime.datetime.fromisoformat(text)
    if moment.tzinfo is not None:
        moment = moment.astimezone(datetime.UTC).replace(tzinfo=None)
    return (moment - datetime.datetime(1970, 1, 1)) // datetime.timedelta(microseconds=1)


def test_parse_dates_reads_csv_iso_strings_as_dates_and_timestamps_with_bad_and_missing_values(tmp_path):
    stamps = ["2024-02-29T23:59:59.5Z", "1969-12-31 23:00:00", "2023-06-01T12:00:00+02:00", "2020-01-01"]
    lines = ["id,day,at,y"]
    for i in range(40):
        day = "" if i == 7 else f"19{50 + i}-0{1 + i % 9}-1{i % 10}"  # line 9: a missing date
        at = "yesterday" if i == 12 else stamps[i % 4]  # line 14: not ISO 8601
        lines.append(f"{i},{day},{at},{i % 2}")
    (tmp_path / "d.csv").write_text("\n".join(lines) + "\n")
    data = DataConfig(source=str(tmp_path / "d.csv"), label="y", parse_dates=("day", "at"), read_chunk_rows=16,
                      on_bad_record="skip")
    manifest = convert(data, str(tmp_path / "out"))
    specs = {f.name: f for f in manifest.feature_schema.features}
    assert (specs["day"].time, specs["day"].source_type) == (TimeKind.DATE, "string")
    assert (specs["at"].time, specs["at"].source_type) == (TimeKind.TIMESTAMP, "string")
    assert manifest.num_bad_records == 1  # the row with "yesterday"; the missing date is imputed
    parsed = read_all(manifest)
    order = np.argsort(parsed["id"])
    ids = parsed["id"][order].tolist()
    assert 12 not in ids and len(ids) == 39
    ordinal = 719_163  # 1970-01-01
    import datetime

    expected_days = [MISSING_INT64 if i == 7 else
                     datetime.date(1950 + i, 1 + i % 9, 10 + i % 10).toordinal() - ordinal for i in ids]
    assert parsed["day"][order].tolist() == expected_days
    assert parsed["at"][order].tolist() == [_instant(stamps[i % 4]) for i in ids]
    with pytest.raises(ConversionError, match=r"line 14.*'at'.*yesterday.*cannot be converted to timestamp"):
        convert(data.model_copy(update={"on_bad_record": OnBadRecord.FAIL}), str(tmp_path / "out2"))


def test_parse_dates_reads_jsonl_strings_and_refuses_a_column_that_is_no_feature(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(
        json.dumps({"k": i, "when": None if i == 4 else f"2001-0{1 + i % 9}-0{1 + i % 9}T0{i % 10}:15:00",
                    "label": i % 2}) + "\n" for i in range(30)))
    data = DataConfig(source=str(path), label="label", parse_dates=("when",), read_chunk_rows=8)
    manifest = convert(data, str(tmp_path / "out"))
    assert manifest.feature_schema.features[1].time == TimeKind.TIMESTAMP
    parsed = read_all(manifest)
    order = np.argsort(parsed["k"])
    assert parsed["when"][order].tolist() == [
        MISSING_INT64 if i == 4 else _instant(f"2001-0{1 + i % 9}-0{1 + i % 9}T0{i % 10}:15:00") for i in range(30)]
    with pytest.raises(ConversionError, match=r"data.parse_dates names \['label', 'nope'\]"):
        convert(data.model_copy(update={"parse_dates": ("label", "nope")}), str(tmp_path / "out"))


def test_parse_dates_on_a_parquet_timestamp_changes_nothing_and_a_time_label_is_refused(tmp_path):
    micros = np.arange(20) * 3_600_000_000 * 7
    pq.write_table(pa.table({"at": pa.array(micros, pa.timestamp("us")), "y": np.arange(20) % 2}),
                   tmp_path / "t.parquet")
    plain = convert(DataConfig(source=str(tmp_path / "t.parquet"), label="y"), str(tmp_path / "a"))
    named = convert(DataConfig(source=str(tmp_path / "t.parquet"), label="y", parse_dates=("at",)), str(tmp_path / "b"))
    assert plain.feature_schema == named.feature_schema
    assert sorted(read_all(named)["at"].tolist()) == micros.tolist()
    with pytest.raises(ConversionError, match="data.label 'at' holds timestamp values"):
        convert(DataConfig(source=str(tmp_path / "t.parquet"), label="at"), str(tmp_path / "c"))
