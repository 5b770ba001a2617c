"""Bulk `tf.train.Example` encoding with numpy: whole columns to serialized Examples, the fast path of conversion.

A per-row ``tf.train.Example(...).SerializeToString()`` loop spends almost all its time in Python. Here a
whole batch of rows is encoded column by column: every protobuf field of a fixed-width numeric column has the
same bytes on every row except the payload, so a batch becomes a few numpy copies into one buffer. The
layout written (field numbers from tensorflow/core/example/{example,feature}.proto):

    Example    { 1: Features }
    Features   { 1: repeated map entry { 1: key (string), 2: Feature } }
    Feature    { 1: BytesList | 2: FloatList | 3: Int64List }
    BytesList  { 1: repeated bytes }        FloatList { 1: packed float }     Int64List { 1: packed varint }

The output parses with ``tf.io.parse_example`` to the same values the per-row writer gives; `framing` wraps it
in TFRecord frames.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

ColumnLike = np.ndarray | pa.Array | pa.ChunkedArray | Sequence[Any]

# Rows assembled at a time: bounds the int64 index arrays of the scatter to a few MiB.
BATCH_ROWS = 8192
_VARINT_LIMITS = np.array([1 << (7 * i) for i in range(1, 10)], dtype=np.uint64)
_U8 = np.uint8


def varint_length(value: int) -> int:
    """Bytes a non-negative int takes as a protobuf varint."""
    length = 1
    while value >= 0x80:
        value >>= 7
        length += 1
    return length


def _varint_bytes(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


# --- pieces: one protobuf fragment per row, either the same width on every row or ragged ---------------------


@dataclass
class Piece:
    """A fragment of every row: `fixed` (rows, width) bytes, or ragged `flat` bytes with per-row `lengths`."""

    fixed: np.ndarray | None = None
    flat: np.ndarray | None = None
    lengths: np.ndarray | None = None
    src_starts: np.ndarray | None = None  # ragged only: where each row's bytes start in `flat`

    def row_lengths(self) -> np.ndarray | int:
        return self.fixed.shape[1] if self.fixed is not None else self.lengths


def _const(data: bytes, num_rows: int) -> Piece:
    return Piece(fixed=np.broadcast_to(np.frombuffer(data, dtype=_U8), (num_rows, len(data))))


def _varint_lengths(values: np.ndarray) -> np.ndarray:
    """Bytes each uint64 takes as a protobuf varint (1..10)."""
    return 1 + np.searchsorted(_VARINT_LIMITS, values, side="right")


def _varints(values: np.ndarray) -> Piece:
    """Varints of a uint64 array, one per row; a fixed piece when they all have the same length."""
    values = np.ascontiguousarray(values, dtype=np.uint64)
    if not len(values):
        return Piece(fixed=np.empty((0, 1), dtype=_U8))
    low, high = varint_length(int(values.min())), varint_length(int(values.max()))
    if high == 1:  # small labels and lengths: the varint is the value's low byte
        return Piece(fixed=values.astype(_U8).reshape(-1, 1))
    width = high
    matrix = np.empty((len(values), width), dtype=_U8)
    for i in range(width):
        matrix[:, i] = ((values >> np.uint64(7 * i)) & np.uint64(0x7F)).astype(_U8) | 0x80
    if low == high:
        matrix[:, -1] &= 0x7F
        return Piece(fixed=matrix)
    lengths = _varint_lengths(values)
    matrix[np.arange(len(values)), lengths - 1] &= 0x7F
    mask = np.arange(width)[None, :] < lengths[:, None]
    return _ragged(matrix[mask], lengths)


def _ragged(flat: np.ndarray, lengths: np.ndarray, src_starts: np.ndarray | None = None) -> Piece:
    lengths = lengths.astype(np.int64)
    if src_starts is None:
        src_starts = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1], out=src_starts[1:])
    return Piece(flat=flat, lengths=lengths, src_starts=src_starts)


def total_lengths(pieces: Sequence[Piece], num_rows: int) -> np.ndarray:
    """Each row's length summed over `pieces`."""
    total = np.zeros(num_rows, dtype=np.int64)
    for piece in pieces:
        total += piece.row_lengths()
    return total


def _length_prefixed(pieces: list[Piece], num_rows: int, tag: int) -> list[Piece]:
    """`tag varint(len) body`: the pieces of a length-delimited field around `pieces`."""
    if all(piece.fixed is not None for piece in pieces):  # the same length on every row: no per-row sums
        head = [_const(bytes([tag]) + _varint_bytes(sum(piece.fixed.shape[1] for piece in pieces)), num_rows)]
        return head + pieces
    body = total_lengths(pieces, num_rows)
    if num_rows == 0 or int(body.min()) == int(body.max()):
        size = int(body[0]) if num_rows else 0
        head = [_const(bytes([tag]) + _varint_bytes(size), num_rows)]
    else:
        head = [_const(bytes([tag]), num_rows), _varints(body.astype(np.uint64))]
    return head + pieces


# --- columns -------------------------------------------------------------------------------------------------


def string_column(values: ColumnLike) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(flat utf-8 bytes, per-row start, per-row length) of a string column, without a Python loop for Arrow."""
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    if not isinstance(values, pa.Array):
        items = values.tolist() if isinstance(values, np.ndarray) else list(values)
        values = pa.array([v.encode("utf-8") if isinstance(v, str) else v for v in items], type=pa.binary())
    if values.null_count:
        raise ValueError(f"string column has {values.null_count} null value(s); encode only complete rows")
    if pa.types.is_string(values.type):
        values = values.cast(pa.binary())
    elif pa.types.is_large_string(values.type):
        values = values.cast(pa.large_binary())
    if not (pa.types.is_binary(values.type) or pa.types.is_large_binary(values.type)):
        raise TypeError(f"expected a string or binary column, got Arrow type {values.type}")
    offset_type = np.int64 if pa.types.is_large_binary(values.type) else np.int32
    buffers = values.buffers()
    if buffers[1] is None:
        offsets = np.zeros(len(values) + 1, dtype=np.int64)
    else:
        offsets = np.frombuffer(buffers[1], dtype=offset_type)[values.offset : values.offset + len(values) + 1]
        offsets = offsets.astype(np.int64)
    data = np.frombuffer(buffers[2], dtype=_U8) if buffers[2] is not None else np.zeros(0, dtype=_U8)
    return data, offsets[:-1], np.diff(offsets)


def varint_words(array: np.ndarray) -> np.ndarray:
    """An int, uint or bool array's values as the uint64 words their varints encode (two's complement for int)."""
    as_int = array.astype(np.int64, copy=False) if array.dtype.kind != "u" else array.astype(np.uint64)
    return as_int.reshape(-1).view(np.uint64)


def _column_pieces(name: str, values: ColumnLike, num_rows: int) -> list[Piece]:
    """The map entry `{1: name, 2: Feature}` of one column on every row, without the entry's own tag."""
    key = name.encode("utf-8")
    array = values if isinstance(values, np.ndarray) else None
    is_string = array is None or array.dtype.kind in "USO"
    if is_string:
        data, starts, lengths = string_column(values)
        payload = _ragged(data, lengths, starts)
        value_pieces = [_const(b"\x0a", num_rows), _varints(lengths.astype(np.uint64)), payload]
        feature_pieces = _length_prefixed(value_pieces, num_rows, 0x0A)  # Feature.bytes_list
    else:
        if array.ndim not in (1, 2) or array.shape[0] != num_rows:
            raise ValueError(
                f"column {name!r} has shape {array.shape}; expected ({num_rows},) or ({num_rows}, n) for n ≥ 1"
            )
        width = 1 if array.ndim == 1 else array.shape[1]
        if width < 1:
            raise ValueError(f"column {name!r} is a vector of length 0; vectors need at least one value")
        if array.dtype.kind == "f":
            floats = np.ascontiguousarray(array, dtype="<f4").reshape(num_rows, width)
            packed = [_const(b"\x0a" + _varint_bytes(4 * width), num_rows), Piece(fixed=floats.view(_U8))]
            feature_pieces = _length_prefixed(packed, num_rows, 0x12)  # Feature.float_list
        elif array.dtype.kind in "iub":
            varints = _varints(varint_words(array))
            if width > 1:
                # Regroup the per-value varints into one ragged payload per row.
                if varints.fixed is not None:
                    varints = Piece(fixed=varints.fixed.reshape(num_rows, -1))
                else:
                    per_row = varints.lengths.reshape(num_rows, width).sum(axis=1)
                    varints = _ragged(varints.flat, per_row)
            packed = _length_prefixed([varints], num_rows, 0x0A)  # Int64List.value, packed
            feature_pieces = _length_prefixed(packed, num_rows, 0x1A)  # Feature.int64_list
        else:
            raise TypeError(f"column {name!r} has unsupported dtype {array.dtype}; use int, float or string values")
    head = [_const(b"\x0a" + _varint_bytes(len(key)) + key, num_rows)]
    value = _length_prefixed(feature_pieces, num_rows, 0x12)  # entry.value
    return head + value


def example_pieces(columns: Mapping[str, ColumnLike], num_rows: int) -> list[Piece]:
    """The pieces of one serialized Example per row: `Example { Features { one entry per column } }`."""
    entries: list[Piece] = []
    for name, values in columns.items():
        entry = _length_prefixed(_column_pieces(name, values, num_rows), num_rows, 0x0A)  # Features.feature
        entries += entry
    example = _length_prefixed(entries, num_rows, 0x0A)  # Example.features
    return example


def count_rows(columns: Mapping[str, ColumnLike]) -> int:
    """The number of rows the columns share; ValueError when there are none or their lengths differ."""
    if not columns:
        raise ValueError("encode needs at least one column")
    counts = {name: len(values) for name, values in columns.items()}
    if len(set(counts.values())) != 1:
        raise ValueError(f"columns have different numbers of rows: {counts}")
    return next(iter(counts.values()))


def slice_rows(values: ColumnLike, start: int, stop: int) -> ColumnLike:
    """Rows [start, stop) of a column, without a copy where the column type allows."""
    if isinstance(values, (pa.Array, pa.ChunkedArray)):
        return values.slice(start, stop - start)
    return values[start:stop]


# --- assembly ------------------------------------------------------------------------------------------------


def assemble(pieces: Sequence[Piece], num_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate the pieces row by row into one buffer; returns (buffer, row offsets of length rows+1)."""
    row_len = total_lengths(pieces, num_rows)
    offsets = np.zeros(num_rows + 1, dtype=np.int64)
    np.cumsum(row_len, out=offsets[1:])
    if all(p.fixed is not None for p in pieces) and num_rows:
        width = int(row_len[0])
        out = np.empty((num_rows, width), dtype=_U8)
        position = 0
        for piece in pieces:
            w = piece.fixed.shape[1]
            out[:, position : position + w] = piece.fixed
            position += w
        return out.reshape(-1), offsets
    out = np.empty(int(offsets[-1]), dtype=_U8)
    position = offsets[:-1].copy()
    for piece in pieces:
        if piece.fixed is not None:
            w = piece.fixed.shape[1]
            if w:
                out[position[:, None] + np.arange(w)] = piece.fixed
            position += w
        else:
            total = int(piece.lengths.sum())
            if total:
                within = np.arange(total) - np.repeat(np.cumsum(piece.lengths) - piece.lengths, piece.lengths)
                out[np.repeat(position, piece.lengths) + within] = piece.flat[np.repeat(piece.src_starts, piece.lengths) + within]
            position += piece.lengths
    return out, offsets


class BufferPool:
    """Byte buffers of written batches, kept for the next ones: fresh pages cost more than encoding into them.

    A new batch-sized array costs the kernel's page faults and zeroing on first touch, several times the CPU of
    encoding a batch into a warm one. Conversion gives a batch's buffer back once its shard writer has written
    (copied) the bytes; at most `max_buffers` idle ones are kept, so memory stays bounded by the batches in flight.
    """

    def __init__(self, max_buffers: int):
        self._free: list[np.ndarray] = []
        self._max = max_buffers
        self._lock = threading.Lock()

    def take(self, num_bytes: int) -> np.ndarray:
        """A uint8 array of `num_bytes` (its contents undefined), from an idle buffer when one is large enough."""
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.nbytes >= num_bytes]
            if fits:
                return self._free.pop(min(fits, key=lambda i: self._free[i].nbytes))[:num_bytes]
        return np.empty(num_bytes, dtype=_U8)

    def clear(self) -> None:
        """Drop the idle buffers (at the end of a conversion: the process may go on to other work)."""
        with self._lock:
            self._free.clear()

    def give_back(self, array: np.ndarray) -> None:
        """Keep `array` for a later `take`: nothing may read or write it any more."""
        buffer = array if array.base is None else array.base
        if not isinstance(buffer, np.ndarray) or buffer.dtype != _U8 or buffer.ndim != 1:
            return
        with self._lock:
            if any(b is buffer for b in self._free):
                return
            self._free.append(buffer)
            if len(self._free) > self._max:  # the smallest goes (arrays compare by value: removed by index)
                del self._free[min(range(len(self._free)), key=lambda i: self._free[i].nbytes)]


# Encoded batches queued for the shard writer thread at most (one being written, the others waiting).
WRITES_IN_FLIGHT = 4
# Buffers of the batches conversion encodes: those queued for the shard writer and the one being encoded.
RECORD_BUFFERS = BufferPool(max_buffers=WRITES_IN_FLIGHT + 1)


@dataclass(frozen=True)
class EncodedBatch:
    """Serialized records back to back in `data`; record i is `data[offsets[i]:offsets[i + 1]]`."""

    data: np.ndarray
    offsets: np.ndarray

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def record(self, index: int) -> bytes:
        return self.data[self.offsets[index] : self.offsets[index + 1]].tobytes()

    def records(self) -> list[bytes]:
        return [self.record(i) for i in range(len(self))]

    def view(self, start: int = 0, stop: int | None = None) -> memoryview:
        """The bytes of records [start, stop) without copying."""
        stop = len(self) if stop is None else stop
        return memoryview(self.data)[self.offsets[start] : self.offsets[stop]]

    def num_bytes(self, start: int = 0, stop: int | None = None) -> int:
        stop = len(self) if stop is None else stop
        return int(self.offsets[stop] - self.offsets[start])

    def rows(self, start: int, stop: int) -> EncodedBatch:
        """Records [start, stop) as a batch of their own, sharing this batch's bytes."""
        offsets = self.offsets[start : stop + 1]
        return EncodedBatch(self.data[offsets[0] : offsets[-1]], offsets - offsets[0])


def concat_batches(batches: Sequence[EncodedBatch]) -> EncodedBatch:
    """The records of `batches` back to back in one batch."""
    if len(batches) == 1:
        return batches[0]
    data = np.concatenate([b.data[b.offsets[0] : b.offsets[-1]] for b in batches])
    lengths = np.concatenate([np.diff(b.offsets) for b in batches])
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return EncodedBatch(data, offsets)


def encode_examples(columns: Mapping[str, ColumnLike]) -> EncodedBatch:
    """Serialize one `tf.train.Example` per row from whole columns.

    Args:
        columns: feature name → values, all with the same number of rows. Integer/bool numpy arrays become
            Int64List (shape (rows,) for scalars, (rows, n) for vectors), float arrays FloatList (stored as
            float32), and string columns (pyarrow string/binary arrays, numpy str/bytes/object arrays or lists
            of str/bytes) BytesList with one value per row. Features are written in mapping order.

    Returns:
        The serialized Example protos back to back, with their offsets.

    Raises:
        ValueError: when the columns differ in length, a vector has length 0 or a string is null.
        TypeError: for an unsupported dtype.
    """
    num_rows = count_rows(columns)
    batches = []
    for start in range(0, max(num_rows, 1), BATCH_ROWS):
        stop = min(start + BATCH_ROWS, num_rows)
        part = {name: slice_rows(values, start, stop) for name, values in columns.items()}
        data, offsets = assemble(example_pieces(part, stop - start), stop - start)
        batches.append(EncodedBatch(data, offsets))
    return concat_batches(batches)
