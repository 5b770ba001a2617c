"""The bundled digits CSV: written to local paths and fsspec URIs, only once by ensure_digits_csv."""

from __future__ import annotations

import csv
import io

import fsspec

from pipeline_lib.config import DataConfig
from pipeline_lib.data import demo as demo_data
from pipeline_lib.data.convert import convert
from pipeline_lib.data.manifest import DType


def test_write_digits_csv_to_a_local_path(tmp_path):
    uri = str(tmp_path / "raw" / "digits.csv")
    assert demo_data.write_digits_csv(uri) == uri
    with open(uri) as handle:
        rows = list(csv.reader(handle))
    assert rows[0] == [f"pixel_{i}" for i in range(64)] + ["target"]
    assert len(rows) == 1 + 1797
    assert {r[-1] for r in rows[1:]} == {str(d) for d in range(10)}
    assert all("." in v for v in rows[1][:64])  # floats, so conversion infers float32 pixels


def test_write_digits_csv_to_memory_and_ensure_keeps_existing():
    fs = fsspec.filesystem("memory")
    uri = "memory://demo-data-test/raw/digits.csv"
    try:
        demo_data.ensure_digits_csv(uri)
        text = fs.cat_file("/demo-data-test/raw/digits.csv").decode()
        assert len(list(csv.reader(io.StringIO(text)))) == 1798
        fs.pipe_file("/demo-data-test/raw/digits.csv", b"kept")
        demo_data.ensure_digits_csv(uri)
        assert fs.cat_file("/demo-data-test/raw/digits.csv") == b"kept"
    finally:
        fs.rm("/demo-data-test", recursive=True)


def test_digits_convert_to_64_float_features_and_10_classes(tmp_path):
    uri = demo_data.write_digits_csv(str(tmp_path / "digits.csv"))
    manifest = convert(DataConfig(source=uri, label="target", target_shard_mb=0.25), str(tmp_path / "out"))
    schema = manifest.feature_schema
    assert len(schema.features) == 64 and {f.dtype for f in schema.features} == {DType.FLOAT32}
    assert schema.num_classes == 10
    assert manifest.num_records("train") + manifest.num_records("eval") == 1797
    assert 250 < manifest.num_records("eval") < 470
