"""The byte layout shared by every Example of fixed-width numeric rows, recorded in the manifest for fast parsing."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from pipeline_lib.data.encoding import (
    ColumnLike,
    count_rows,
    varint_length,
    varint_words,
)
from pipeline_lib.data.manifest import FieldLayout, RecordLayout


def _delimited(body: int) -> int:
    """Bytes of a length-delimited field's tag and length, for a body of `body` bytes."""
    return 1 + varint_length(body)


def record_layout(columns: Mapping[str, ColumnLike]) -> RecordLayout | None:
    """The byte layout every Example that `encode_examples(columns)` writes shares, or None if they differ.

    Rows have one layout when every column is numeric and each int64 column's varints have one length on
    every row (values 0 ≤ v < 2^63; a negative int64 takes 10 bytes and is left to the parser). Offsets are
    computed from the same field structure the encoder writes (see `pipeline_lib.data.encoding`); the tests check
    them against encoded records.
    """
    if not columns or count_rows(columns) == 0:
        return None
    entries: list[tuple[str, int, int, int]] = []  # name, payload offset after the Example's head, count, varint
    position = 0
    for name, values in columns.items():
        if not isinstance(values, np.ndarray) or values.dtype.kind not in "fiub" or values.ndim not in (1, 2):
            return None
        count = 1 if values.ndim == 1 else values.shape[1]
        if count < 1:
            return None
        if values.dtype.kind == "f":
            varint_bytes, payload = 0, 4 * count
        else:
            words = varint_words(values)
            varint_bytes = varint_length(int(words.max()))
            if varint_bytes > 9 or varint_length(int(words.min())) != varint_bytes:
                return None
            payload = varint_bytes * count
        key = len(name.encode("utf-8"))
        packed = _delimited(payload) + payload  # FloatList / Int64List { 1: packed values }
        feature = _delimited(packed) + packed  # Feature { 2: FloatList | 3: Int64List }
        body = _delimited(key) + key + _delimited(feature) + feature  # map entry { 1: key, 2: Feature }
        before = _delimited(body) + _delimited(key) + key + _delimited(feature) + _delimited(packed) + _delimited(payload)
        entries.append((name, position + before, count, varint_bytes))
        position += _delimited(body) + body
    head = _delimited(position)  # Example { 1: Features { the entries } }
    return RecordLayout(
        record_bytes=head + position,
        fields=tuple(FieldLayout(name=name, offset=head + offset, count=count, varint_bytes=varint_bytes)
                     for name, offset, count, varint_bytes in entries),
    )

