"""Bad records: fail naming file, line, column and value, or skip and count them."""

from __future__ import annotations

import json
import logging

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline_lib.config import DataConfig
from pipeline_lib.data.convert import convert
from pipeline_lib.data.errors import ConversionError
from pipeline_lib.data.manifest import MANIFEST_NAME
from tests.pipeline_lib.data.conversion_support import csv_with_bad_rows, read_all


def test_bad_value_fails_naming_file_line_column_and_value(tmp_path):
    source = csv_with_bad_rows(tmp_path / "bad.csv")
    for chunk in (4, 3):  # the first chunk (lines 2-4 or 2-5) is clean, so 'size' is inferred as int64
        with pytest.raises(ConversionError) as error:
            convert(DataConfig(source=source, label="y", read_chunk_rows=chunk), str(tmp_path / "out"))
        message = str(error.value)
        assert "bad.csv line 6" in message and "column 'size'" in message and "'abc'" in message
        assert "on_bad_record: skip" in message
    assert not list((tmp_path / "out").rglob(MANIFEST_NAME))


def test_bad_rows_skip_counts_them(tmp_path, caplog):
    source = csv_with_bad_rows(tmp_path / "bad.csv")
    with caplog.at_level(logging.WARNING, logger="pipeline_lib.data.bad_records"):
        manifest = convert(DataConfig(source=source, label="y", on_bad_record="skip", missing="skip",
                                      read_chunk_rows=4),
                           str(tmp_path / "out"))
    assert manifest.num_bad_records == 3
    assert sorted(read_all(manifest)["id"].tolist()) == [1, 2, 3, 4, 6, 7]
    assert "line 6" in caplog.text and "line 10" in caplog.text and "line 11" in caplog.text


def test_bad_rows_in_jsonl_and_parquet(tmp_path):
    path = tmp_path / "d.jsonl"
    records = [{"v": [1.0, 2.0], "y": 0}, {"v": [1.0, 2.0], "y": 1}, {"v": [3.0], "y": 0}, {"y": 1},
               {"v": [1.0, 2.0], "y": 2}]
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n{not json\n")
    with pytest.raises(ConversionError) as error:
        convert(DataConfig(source=str(path), label="y"), str(tmp_path / "out"))
    assert "d.jsonl line 3" in str(error.value) and "column 'v'" in str(error.value)
    assert "[3.0]" in str(error.value) and "length 2" in str(error.value)
    manifest = convert(DataConfig(source=str(path), label="y", on_bad_record="skip", missing="skip"),
                       str(tmp_path / "o"))
    assert manifest.num_bad_records == 3 and manifest.feature_schema.num_classes == 3
    # By default (data.missing: impute) the row without "v" is a missing value, not a bad record: written as NaN.
    imputed = convert(DataConfig(source=str(path), label="y", on_bad_record="skip"), str(tmp_path / "imputed"))
    assert imputed.num_bad_records == 2
    rows = {split: read_all(imputed, split) for split in ("train", "eval")}
    vectors = np.concatenate([np.stack(r["v"]).reshape(-1, 2) for r in rows.values() if len(r["y"])])
    assert np.isnan(vectors).all(axis=1).sum() == 1 and np.isnan(vectors).any(axis=1).sum() == 1

    pq.write_table(pa.table({"a": pa.array([1.0, None, 3.0]), "y": pa.array([0, 1, -1])}), tmp_path / "p.parquet")
    with pytest.raises(ConversionError) as error:
        convert(DataConfig(source=str(tmp_path / "p.parquet"), label="y", missing="fail"), str(tmp_path / "out"))
    assert "p.parquet row 2" in str(error.value) and "column 'a'" in str(error.value) and "missing" in str(error.value)
    manifest = convert(DataConfig(source=str(tmp_path / "p.parquet"), label="y", on_bad_record="skip",
                                  missing="skip"), str(tmp_path / "o"))
    assert manifest.num_bad_records == 2  # the null and the negative class label
