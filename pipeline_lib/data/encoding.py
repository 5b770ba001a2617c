"""Bulk `tf.train.Example` encoding with numpy, plus TFRecord framing: the fast path of conversion.

A per-row ``tf.train.Example(...).SerializeToString()`` loop spends almost all its time in Python. Here a
whole batch of rows is encoded column by column: every protobuf field of a fixed-width numeric column has the
same bytes on every row except the payload, so a batch becomes a few numpy copies into one buffer. The
layout written (field numbers from tensorflow/core/example/{example,feature}.proto):

    Example    { 1: Features }
    Features   { 1: repeated map entry { 1: key (string), 2: Feature } }
    Feature    { 1: BytesList | 2: FloatList | 3: Int64List }
    BytesList  { 1: repeated bytes }        FloatList { 1: packed float }     Int64List { 1: packed varint }

TFRecord framing: ``uint64 length | uint32 masked_crc32c(length) | data | uint32 masked_crc32c(data)``, all
little-endian. The output parses with ``tf.io.parse_example`` to the same values the per-row writer gives.
"""

from __future__ import annotations

import errno
import fcntl
import gzip
import hashlib
import mmap
import os
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, BinaryIO

import crc32c as _crc32c
import numpy as np
import pyarrow as pa

from pipeline_lib.core import native
from pipeline_lib.data.manifest import FieldLayout, RecordLayout

ColumnLike = np.ndarray | pa.Array | pa.ChunkedArray | Sequence[Any]

# Rows assembled at a time: bounds the int64 index arrays of the scatter to a few MiB.
_BATCH_ROWS = 8192
# Rows framed in one piece when every field has a fixed width (no index arrays: memory is the output itself).
_FIXED_ROWS = 1 << 17
_MASK_DELTA = 0xA282EAD8
_VARINT_LIMITS = np.array([1 << (7 * i) for i in range(1, 10)], dtype=np.uint64)
_U8 = np.uint8


def masked_crc32c(data: bytes | memoryview) -> int:
    """TFRecord's masked CRC32C of `data` (rotated right by 15 bits plus a constant)."""
    crc = _crc32c.crc32c(data)
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def _mask(crc: np.ndarray) -> np.ndarray:
    crc = crc.astype(np.uint64)
    return ((((crc >> np.uint64(15)) | (crc << np.uint64(17))) + np.uint64(_MASK_DELTA)) & np.uint64(0xFFFFFFFF)).astype(
        "<u4"
    )


def _varint_len_scalar(value: int) -> int:
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
class _Piece:
    """A fragment of every row: `fixed` (rows, width) bytes, or ragged `flat` bytes with per-row `lengths`."""

    fixed: np.ndarray | None = None
    flat: np.ndarray | None = None
    lengths: np.ndarray | None = None
    src_starts: np.ndarray | None = None  # ragged only: where each row's bytes start in `flat`

    def row_lengths(self) -> np.ndarray | int:
        return self.fixed.shape[1] if self.fixed is not None else self.lengths


def _const(data: bytes, num_rows: int) -> _Piece:
    return _Piece(fixed=np.broadcast_to(np.frombuffer(data, dtype=_U8), (num_rows, len(data))))


def _varint_lengths(values: np.ndarray) -> np.ndarray:
    """Bytes each uint64 takes as a protobuf varint (1..10)."""
    return 1 + np.searchsorted(_VARINT_LIMITS, values, side="right")


def _varints(values: np.ndarray) -> _Piece:
    """Varints of a uint64 array, one per row; a fixed piece when they all have the same length."""
    values = np.ascontiguousarray(values, dtype=np.uint64)
    if not len(values):
        return _Piece(fixed=np.empty((0, 1), dtype=_U8))
    low, high = _varint_len_scalar(int(values.min())), _varint_len_scalar(int(values.max()))
    if high == 1:  # small labels and lengths: the varint is the value's low byte
        return _Piece(fixed=values.astype(_U8).reshape(-1, 1))
    width = high
    matrix = np.empty((len(values), width), dtype=_U8)
    for i in range(width):
        matrix[:, i] = ((values >> np.uint64(7 * i)) & np.uint64(0x7F)).astype(_U8) | 0x80
    if low == high:
        matrix[:, -1] &= 0x7F
        return _Piece(fixed=matrix)
    lengths = _varint_lengths(values)
    matrix[np.arange(len(values)), lengths - 1] &= 0x7F
    mask = np.arange(width)[None, :] < lengths[:, None]
    return _ragged(matrix[mask], lengths)


def _ragged(flat: np.ndarray, lengths: np.ndarray, src_starts: np.ndarray | None = None) -> _Piece:
    lengths = lengths.astype(np.int64)
    if src_starts is None:
        src_starts = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1], out=src_starts[1:])
    return _Piece(flat=flat, lengths=lengths, src_starts=src_starts)


def _total(pieces: Sequence[_Piece], num_rows: int) -> np.ndarray:
    total = np.zeros(num_rows, dtype=np.int64)
    for piece in pieces:
        total += piece.row_lengths()
    return total


def _length_prefixed(pieces: list[_Piece], num_rows: int, tag: int) -> list[_Piece]:
    """`tag varint(len) body`: the pieces of a length-delimited field around `pieces`."""
    if all(piece.fixed is not None for piece in pieces):  # the same length on every row: no per-row sums
        head = [_const(bytes([tag]) + _varint_bytes(sum(piece.fixed.shape[1] for piece in pieces)), num_rows)]
        return head + pieces
    body = _total(pieces, num_rows)
    if num_rows == 0 or int(body.min()) == int(body.max()):
        size = int(body[0]) if num_rows else 0
        head = [_const(bytes([tag]) + _varint_bytes(size), num_rows)]
    else:
        head = [_const(bytes([tag]), num_rows), _varints(body.astype(np.uint64))]
    return head + pieces


# --- columns -------------------------------------------------------------------------------------------------


def _string_column(values: ColumnLike) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
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


def _varint_words(array: np.ndarray) -> np.ndarray:
    """An int, uint or bool array's values as the uint64 words their varints encode (two's complement for int)."""
    as_int = array.astype(np.int64, copy=False) if array.dtype.kind != "u" else array.astype(np.uint64)
    return as_int.reshape(-1).view(np.uint64)


def _column_pieces(name: str, values: ColumnLike, num_rows: int) -> list[_Piece]:
    """The map entry `{1: name, 2: Feature}` of one column on every row, without the entry's own tag."""
    key = name.encode("utf-8")
    array = values if isinstance(values, np.ndarray) else None
    is_string = array is None or array.dtype.kind in "USO"
    if is_string:
        data, starts, lengths = _string_column(values)
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
            packed = [_const(b"\x0a" + _varint_bytes(4 * width), num_rows), _Piece(fixed=floats.view(_U8))]
            feature_pieces = _length_prefixed(packed, num_rows, 0x12)  # Feature.float_list
        elif array.dtype.kind in "iub":
            varints = _varints(_varint_words(array))
            if width > 1:
                # Regroup the per-value varints into one ragged payload per row.
                if varints.fixed is not None:
                    varints = _Piece(fixed=varints.fixed.reshape(num_rows, -1))
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


def _example_pieces(columns: Mapping[str, ColumnLike], num_rows: int) -> list[_Piece]:
    entries: list[_Piece] = []
    for name, values in columns.items():
        entry = _length_prefixed(_column_pieces(name, values, num_rows), num_rows, 0x0A)  # Features.feature
        entries += entry
    example = _length_prefixed(entries, num_rows, 0x0A)  # Example.features
    return example


def _delimited(body: int) -> int:
    """Bytes of a length-delimited field's tag and length, for a body of `body` bytes."""
    return 1 + _varint_len_scalar(body)


def record_layout(columns: Mapping[str, ColumnLike]) -> RecordLayout | None:
    """The byte layout every Example that `encode_examples(columns)` writes shares, or None if they differ.

    Rows have one layout when every column is numeric and each int64 column's varints have one length on
    every row (values 0 ≤ v < 2^63; a negative int64 takes 10 bytes and is left to the parser). Offsets are
    computed from the same field structure the encoder writes (see the module docstring); the tests check
    them against encoded records.
    """
    if not columns or _num_rows(columns) == 0:
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
            words = _varint_words(values)
            varint_bytes = _varint_len_scalar(int(words.max()))
            if varint_bytes > 9 or _varint_len_scalar(int(words.min())) != varint_bytes:
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


def _num_rows(columns: Mapping[str, ColumnLike]) -> int:
    if not columns:
        raise ValueError("encode needs at least one column")
    counts = {name: len(values) for name, values in columns.items()}
    if len(set(counts.values())) != 1:
        raise ValueError(f"columns have different numbers of rows: {counts}")
    return next(iter(counts.values()))


def _slice(values: ColumnLike, start: int, stop: int) -> ColumnLike:
    if isinstance(values, (pa.Array, pa.ChunkedArray)):
        return values.slice(start, stop - start)
    return values[start:stop]


# --- assembly ------------------------------------------------------------------------------------------------


def _assemble(pieces: Sequence[_Piece], num_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate the pieces row by row into one buffer; returns (buffer, row offsets of length rows+1)."""
    row_len = _total(pieces, num_rows)
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


def _concat(batches: Sequence[EncodedBatch]) -> EncodedBatch:
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
    num_rows = _num_rows(columns)
    batches = []
    for start in range(0, max(num_rows, 1), _BATCH_ROWS):
        stop = min(start + _BATCH_ROWS, num_rows)
        part = {name: _slice(values, start, stop) for name, values in columns.items()}
        data, offsets = _assemble(_example_pieces(part, stop - start), stop - start)
        batches.append(EncodedBatch(data, offsets))
    return _concat(batches)


def _record_crcs(data: np.ndarray, starts: Sequence[int], size: int | None = None,
                 ends: Sequence[int] | None = None) -> np.ndarray:
    """Masked crc32c of data[start:start + size] (or data[start:end]) for each start, as (n, 4) little-endian bytes."""
    view = memoryview(data)
    value = _crc32c.crc32c
    # One C call per record; a list comprehension over ints is the cheapest Python loop around it.
    if size is not None:
        crcs = [value(view[s : s + size]) for s in starts]
    else:
        crcs = [value(view[s:e]) for s, e in zip(starts, ends)]
    return _mask(np.array(crcs, dtype=np.uint64)).view(_U8).reshape(-1, 4)


def _fixed_tfrecords(example: Sequence[_Piece], rows: int, size: int, order: np.ndarray | None = None) -> EncodedBatch:
    """Frame rows whose pieces all have the same width: a template row of the constant bytes, then the columns.

    Constant pieces (stride 0: tags, keys, lengths) are copied once into the template instead of once per row,
    so a row of a few numeric columns costs one template copy, one copy per column and one crc. With `order`,
    output record j is source row order[j] (a reordering or selection, at no extra pass over the bytes).
    """
    width = 12 + size + 4
    template = np.zeros(width, dtype=_U8)
    template[:8] = np.frombuffer(size.to_bytes(8, "little"), dtype=_U8)
    template[8:12] = np.frombuffer(masked_crc32c(size.to_bytes(8, "little")).to_bytes(4, "little"), dtype=_U8)
    variable: list[tuple[int, np.ndarray]] = []
    position = 12
    for piece in example:
        fixed = piece.fixed
        w = fixed.shape[1]
        if w and fixed.strides[0] == 0:
            template[position : position + w] = fixed[0]
        elif w:
            variable.append((position, fixed if fixed.strides[1] == 1 else np.ascontiguousarray(fixed)))
        position += w
    out_rows = rows if order is None else len(order)
    out = np.empty((out_rows, width), dtype=_U8)
    if out_rows and native.module is not None:
        # Template, columns and CRC of each record in one pass, with the GIL released.
        native.module.frame_rows(out, template, variable, order)
    elif out_rows:
        out[:] = template
        for position, fixed in variable:
            out[:, position : position + fixed.shape[1]] = fixed if order is None else fixed[order]
        out[:, -4:] = _record_crcs(out.reshape(-1), range(12, out_rows * width, width), size)
    return EncodedBatch(out.reshape(-1), np.arange(out_rows + 1, dtype=np.int64) * width)


def _take(values: ColumnLike, order: np.ndarray) -> ColumnLike:
    if isinstance(values, (pa.Array, pa.ChunkedArray)):
        return values.take(pa.array(order))
    if isinstance(values, np.ndarray):
        return values[order]
    return [values[i] for i in order.tolist()]


def encode_tfrecords(columns: Mapping[str, ColumnLike], order: np.ndarray | None = None) -> EncodedBatch:
    """Like `encode_examples`, but every record framed for a TFRecord file (length, data and masked CRCs).

    Writing `batch.view()` to a file gives the same file `tf.io.TFRecordWriter` writes for these Examples
    (up to the order of features inside each Example, which protobuf maps leave free). With `order` (row
    indices), record j is row order[j]: conversion passes eval rows then train rows and slices the result.
    """
    num_rows = _num_rows(columns)
    if order is not None:
        order = np.ascontiguousarray(order, dtype=np.int64)
        if len(order) and (int(order.min()) < 0 or int(order.max()) >= num_rows):
            raise IndexError(f"order holds row indices outside 0..{num_rows - 1}")
    if 0 < num_rows <= _FIXED_ROWS:
        # Fixed-width numeric rows (every varint the same length) need no index arrays: the whole input at once.
        example = _example_pieces(columns, num_rows)
        if all(piece.fixed is not None for piece in example):
            return _fixed_tfrecords(example, num_rows, int(_total(example, 1)[0]), order)
    if order is not None:
        columns = {name: _take(values, order) for name, values in columns.items()}
        num_rows = len(order)
    batches = []
    length_crcs: dict[int, bytes] = {}
    for start in range(0, max(num_rows, 1), _BATCH_ROWS):
        stop = min(start + _BATCH_ROWS, num_rows)
        rows = stop - start
        part = {name: _slice(values, start, stop) for name, values in columns.items()}
        example = _example_pieces(part, rows)
        if rows and all(piece.fixed is not None for piece in example):
            batches.append(_fixed_tfrecords(example, rows, int(_total(example, 1)[0])))
            continue
        sizes = _total(example, rows)
        # uint64 length and its masked crc: identical for rows of the same size, so computed once per size.
        header = np.empty((rows, 12), dtype=_U8)
        header[:, :8] = sizes.astype("<u8").view(_U8).reshape(rows, 8)
        unique, inverse = np.unique(sizes, return_inverse=True)
        crc_table = np.empty((len(unique), 4), dtype=_U8)
        for i, size in enumerate(unique.tolist()):
            if size not in length_crcs:
                length_crcs[size] = masked_crc32c(int(size).to_bytes(8, "little")).to_bytes(4, "little")
            crc_table[i] = np.frombuffer(length_crcs[size], dtype=_U8)
        header[:, 8:] = crc_table[inverse.reshape(-1)]
        footer = np.zeros((rows, 4), dtype=_U8)
        data, offsets = _assemble([_Piece(fixed=header), *example, _Piece(fixed=footer)], rows)
        if native.module is not None:
            native.module.frame_offsets(data, offsets)
        else:
            ends = offsets[1:] - 4
            masked = _record_crcs(data, (offsets[:-1] + 12).tolist(), ends=ends.tolist())
            if rows and int(sizes.min()) == int(sizes.max()):
                data.reshape(rows, -1)[:, -4:] = masked
            else:
                data[ends[:, None] + np.arange(4)] = masked
        batches.append(EncodedBatch(data, offsets))
    return _concat(batches)


# --- files ---------------------------------------------------------------------------------------------------


# Writes at least this large are hashed on the `hasher` thread while the calling thread writes them, and (in
# durable files) handed to the device right away.
_LARGE_WRITE_BYTES = 1 << 20


# O_DIRECT writes: the alignment of buffer, file offset and length that every Linux block device accepts, and
# the size of one write (a bigger one gains nothing measurable here).
_DIRECT_ALIGN = 4096
_DIRECT_BLOCK = 4 << 20
# Aligned block buffers of closed files, kept for the next one: mapping fresh pages for each file (page faults,
# zeroing, unmapping) cost more than all its copies. Conversion has at most four files open at once.
_FREE_BUFFERS: list[mmap.mmap] = []
_FREE_BUFFERS_LOCK = threading.Lock()
_MAX_FREE_BUFFERS = 4


def _take_buffer() -> mmap.mmap:
    with _FREE_BUFFERS_LOCK:
        if _FREE_BUFFERS:
            return _FREE_BUFFERS.pop()
    return mmap.mmap(-1, _DIRECT_BLOCK)  # anonymous memory: page-aligned


def _give_back(buffer: mmap.mmap) -> None:
    with _FREE_BUFFERS_LOCK:
        if len(_FREE_BUFFERS) < _MAX_FREE_BUFFERS:
            _FREE_BUFFERS.append(buffer)
            return
    buffer.close()


class _DirectFile:
    """A new local file written with O_DIRECT: whole 4 MiB blocks go from an aligned buffer to the device.

    A buffered write copies every byte into the page cache, and the kernel's handling of those pages (allocating,
    writing back, reclaiming) costs more than the copy and varies from run to run: 356 MB of shards took
    0.3-1.1 s of wall time and 0.1-0.8 CPU-s with write() + fsync on this machine, against 0.26-0.32 s and 0.05
    CPU-s written direct. Data is copied into the aligned buffer (O_DIRECT needs aligned memory, offsets and
    lengths) and written a block at a time. `close()` writes the last block padded to the alignment, truncates
    the file to its true length and fsyncs it: O_DIRECT bypasses the page cache, not the device's write cache
    or the file's metadata. Where a file system refuses O_DIRECT, at open or at the first write (tmpfs before
    Linux 6.6, some FUSE and network mounts), the same file carries on with plain writes.
    """

    def __init__(self, path: str):
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
        try:
            self._fd = os.open(path, flags | os.O_DIRECT, 0o666)
            self.direct = True
        except OSError as error:
            if error.errno != errno.EINVAL:
                raise
            self._fd = os.open(path, flags, 0o666)
            self.direct = False
        self._buffer = _take_buffer()
        self._view = memoryview(self._buffer)
        self._fill = 0
        self.size = 0  # bytes in the file so far, the buffered ones included

    def write(self, data) -> int:
        source = memoryview(data).cast("B")
        taken = 0
        while taken < len(source):
            step = min(len(source) - taken, _DIRECT_BLOCK - self._fill)
            self._view[self._fill:self._fill + step] = source[taken:taken + step]
            self._fill += step
            taken += step
            if self._fill == _DIRECT_BLOCK:
                self._write_out(_DIRECT_BLOCK)
        self.size += taken
        return taken

    def flush(self) -> None:
        """Nothing to do: bytes short of a whole block stay in the buffer until close()."""

    def _write_out(self, length: int) -> None:
        done = 0
        while done < length:
            try:
                done += os.write(self._fd, self._view[done:length])
            except OSError as error:
                if error.errno != errno.EINVAL or not self.direct:
                    raise
                # The file system took O_DIRECT at open but refuses its writes (or a short write left the rest
                # unaligned): the rest of the file is written through the page cache.
                fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) & ~os.O_DIRECT)
                self.direct = False
        self._fill = 0

    def close(self) -> None:
        """Write what the buffer holds, truncate to the bytes written, fsync and close."""
        try:
            tail = self._fill
            if tail:
                length = -(-tail // _DIRECT_ALIGN) * _DIRECT_ALIGN if self.direct else tail
                self._view[tail:length] = bytes(length - tail)
                self._write_out(length)
                if length != tail:
                    os.ftruncate(self._fd, self.size)  # the zeros after the last byte
            os.fsync(self._fd)
        finally:
            self.abort()

    def abort(self) -> None:
        """Close without writing the buffered tail (the file is left short: the caller removes it)."""
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)
            self._view.release()
            _give_back(self._buffer)


class _HashingWriter:
    """A write-only file wrapper that counts and sha256-hashes what reaches the underlying file.

    With a `hasher` executor, a large write is hashed there while this thread copies it to the file (hashlib
    and file writes both release the GIL), and `write` returns once both are done: the digest stays in order.
    """

    def __init__(self, raw: BinaryIO, hasher: Executor | None = None, writeback: bool = False):
        self._raw = raw
        self._hasher = hasher
        # Durable files: each large write is handed to the device at once, so the fsync at close waits for
        # the last blocks only instead of the whole file (a hint; without the C extension it is skipped).
        self._writeback = writeback and native.module is not None
        self.sha256 = hashlib.sha256()
        self.num_bytes = 0

    def write(self, data) -> int:
        size = memoryview(data).nbytes
        if self._hasher is not None and size >= _LARGE_WRITE_BYTES:
            hashed = self._hasher.submit(self.sha256.update, data)
            try:
                self._raw.write(data)
            finally:
                hashed.result()
        else:
            self._raw.write(data)
            self.sha256.update(data)
        if self._writeback and size >= _LARGE_WRITE_BYTES:
            self._raw.flush()
            native.module.start_writeback(self._raw.fileno(), self.num_bytes, size)
        self.num_bytes += size
        return size

    def flush(self) -> None:
        self._raw.flush()


class TFRecordFileWriter:
    """Appends framed records (an `EncodedBatch` from `encode_tfrecords`) to one local TFRecord file.

    With `compression="gzip"` the file is one gzip stream (mtime 0, so reruns write identical bytes), which
    `tf.data.TFRecordDataset(..., compression_type="GZIP")` reads. Tracks records, file bytes and sha256.
    With `durable=True`, `close()` returns only once the bytes are on the storage device (fsync): a manifest
    written after it can never name a shard that a crash left short. A durable file is written with O_DIRECT
    (`_DirectFile`) unless `direct=False`: conversion never reads a shard back, so caching its pages only costs
    CPU (training's first epoch then reads from the device: 1.3 GB/s cold here, ten times what it consumes). With
    a `hasher` executor, large writes are hashed on it beside the file write.
    """

    def __init__(self, path: str, compression: str = "none", durable: bool = False, hasher: Executor | None = None,
                 direct: bool = True):
        if compression not in ("none", "gzip"):
            raise ValueError(f"compression {compression!r} is not supported; use 'none' or 'gzip'")
        self.path = path
        self.durable = durable
        self._direct = durable and direct and hasattr(os, "O_DIRECT")
        self._file: BinaryIO | _DirectFile
        if self._direct:
            self._file = _DirectFile(path)
        else:
            self._file = open(path, "wb")  # noqa: SIM115  (closed by close() or abort(); the writer outlives a with-block)
        self._hashing = _HashingWriter(self._file, hasher, writeback=durable and not self._direct)
        self._gzip = gzip.GzipFile(filename="", mode="wb", fileobj=self._hashing, mtime=0) if compression == "gzip" else None
        self.num_records = 0
        self.num_uncompressed_bytes = 0

    def write(self, batch: EncodedBatch, start: int = 0, stop: int | None = None) -> None:
        stop = len(batch) if stop is None else stop
        if stop <= start:
            return
        view = batch.view(start, stop)
        (self._gzip or self._hashing).write(view)
        self.num_records += stop - start
        self.num_uncompressed_bytes += view.nbytes

    def close(self) -> tuple[int, int, str]:
        """Close the file; returns (records, bytes on disk, sha256 hex of the file)."""
        if self._gzip is not None:
            self._gzip.close()
        if self.durable and not self._direct:
            self._file.flush()
            os.fsync(self._file.fileno())
        self._file.close()  # a _DirectFile writes its last block and fsyncs here
        return self.num_records, self._hashing.num_bytes, self._hashing.sha256.hexdigest()

    def abort(self) -> None:
        try:
            if self._gzip is not None:
                self._gzip.close()
        finally:
            (self._file.abort if self._direct else self._file.close)()
