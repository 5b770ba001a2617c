"""The recorded byte layout places every value where the encoder wrote it, or is None."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from pipeline_lib.data import encoding
from pipeline_lib.data.record_layout import record_layout


def _fixed_columns(num_rows: int, seed: int = 0) -> dict:
    """Numbers only, each int column's varints one length: rows with one byte layout (long keys, wide vectors and
    multi-byte varints make the length prefixes multi-byte too)."""
    rng = np.random.default_rng(seed)
    return {
        "x": rng.normal(size=(num_rows, 40)).astype(np.float32),
        "k" * 200: rng.integers(1 << 14, 1 << 21, size=num_rows),  # 3-byte varints
        "ids": rng.integers(128, 1 << 14, size=(num_rows, 3)).astype(np.uint32),  # 2-byte varints
        "flag": (np.arange(num_rows) % 2).astype(bool),
        "f": rng.normal(size=num_rows).astype(np.float32),
        "label": rng.integers(0, 10, size=num_rows),
    }


def test_record_layout_places_every_value_where_the_encoder_wrote_it():
    columns = _fixed_columns(30)
    layout = record_layout(columns)
    assert layout is not None and [f.name for f in layout.fields] == list(columns)
    batch = encoding.encode_examples(columns)
    for row in range(30):
        record = bytes(batch.view(row, row + 1))
        assert len(record) == layout.record_bytes
        for field in layout.fields:
            expected = np.asarray(columns[field.name][row]).reshape(-1)
            if field.varint_bytes == 0:
                got = np.frombuffer(record, "<f4", count=field.count, offset=field.offset)
                np.testing.assert_array_equal(got, expected)
            else:
                groups = np.frombuffer(record, np.uint8, count=field.count * field.varint_bytes, offset=field.offset)
                groups = groups.reshape(field.count, field.varint_bytes).astype(np.int64)
                got = ((groups & 0x7F) << (7 * np.arange(field.varint_bytes))).sum(axis=1)
                np.testing.assert_array_equal(got, expected.astype(np.int64))


@pytest.mark.parametrize("columns", [
    {"x": np.array([1.0], np.float32), "s": pa.array(["a"])},  # a string column
    {"n": np.array([5, 200])},  # varints of 1 and 2 bytes
    {"n": np.array([-1, -2])},  # negative int64: 10-byte varints, left to the parser
    {"v": np.zeros((2, 0), np.float32)},  # empty vectors
    {"n": np.array([], np.int64)},  # no rows
])
def test_rows_without_one_layout_have_none(columns):
    assert record_layout(columns) is None
