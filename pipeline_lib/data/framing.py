"""TFRecord framing: `uint64 length | uint32 masked_crc32c(length) | data | uint32 masked_crc32c(data)`.

All little-endian. Writing `encode_tfrecords(columns).view()` to a file gives the file `tf.io.TFRecordWriter`
writes for the same Examples. The per-record loops run in the optional C extension (`pipeline_lib.core.native`)
when it is built, and in numpy otherwise, with the same bytes.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import crc32c as _crc32c
import numpy as np
import pyarrow as pa

from pipeline_lib.core import native
from pipeline_lib.data.encoding import (
    BATCH_ROWS,
    RECORD_BUFFERS,
    ColumnLike,
    EncodedBatch,
    Piece,
    assemble,
    concat_batches,
    count_rows,
    example_pieces,
    slice_rows,
    total_lengths,
)

# Rows framed in one piece when every field has a fixed width (no index arrays: memory is the output itself).
_FIXED_ROWS = 1 << 17
_MASK_DELTA = 0xA282EAD8
_U8 = np.uint8


def masked_crc32c(data: bytes | memoryview) -> int:
    """TFRecord's masked CRC32C of `data`."""
    return int(_mask(np.array([_crc32c.crc32c(data)], dtype=np.uint64))[0])


def _mask(crc: np.ndarray) -> np.ndarray:
    """TFRecord's mask of CRC32C values (rotated right by 15 bits plus a constant), as little-endian uint32."""
    crc = crc.astype(np.uint64)
    return ((((crc >> np.uint64(15)) | (crc << np.uint64(17))) + np.uint64(_MASK_DELTA)) & np.uint64(0xFFFFFFFF)).astype(
        "<u4"
    )


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


def _fixed_tfrecords(example: Sequence[Piece], rows: int, size: int, order: np.ndarray | None = None) -> EncodedBatch:
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
    out = RECORD_BUFFERS.take(out_rows * width).reshape(out_rows, width)
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


def encode_tfrecord_parts(columns: Mapping[str, ColumnLike], order: np.ndarray, part_bytes: int) -> Iterator[EncodedBatch]:
    """`encode_tfrecords(columns, order)` as consecutive batches of about `part_bytes` each (records in `order`).

    Fixed-width rows are framed a part at a time, so each part can be written (and its buffer reused) while the
    next is framed, and stays in cache between its framing, its copy and its digest; rows of varying width come
    as one batch.
    """
    num_rows = count_rows(columns)
    order = _checked_order(order, num_rows)
    fixed = _fixed_example(columns, num_rows)
    if fixed is None:
        yield _variable_tfrecords(columns, order, num_rows)
        return
    example, size = fixed
    step = max(1, part_bytes // (16 + size))
    for start in range(0, max(len(order), 1), step):
        yield _fixed_tfrecords(example, num_rows, size, order[start : start + step])


def encode_tfrecords(columns: Mapping[str, ColumnLike], order: np.ndarray | None = None) -> EncodedBatch:
    """Like `encode_examples`, but every record framed for a TFRecord file (length, data and masked CRCs).

    Writing `batch.view()` to a file gives the same file `tf.io.TFRecordWriter` writes for these Examples
    (up to the order of features inside each Example, which protobuf maps leave free). With `order` (row
    indices), record j is row order[j]: conversion passes eval rows then train rows and slices the result.
    """
    num_rows = count_rows(columns)
    if order is not None:
        order = _checked_order(order, num_rows)
    fixed = _fixed_example(columns, num_rows)
    if fixed is not None:
        example, size = fixed
        return _fixed_tfrecords(example, num_rows, size, order)
    return _variable_tfrecords(columns, order, num_rows)


def _checked_order(order: np.ndarray, num_rows: int) -> np.ndarray:
    order = np.ascontiguousarray(order, dtype=np.int64)
    if len(order) and (int(order.min()) < 0 or int(order.max()) >= num_rows):
        raise IndexError(f"order holds row indices outside 0..{num_rows - 1}")
    return order


def _fixed_example(columns: Mapping[str, ColumnLike], num_rows: int) -> tuple[list[Piece], int] | None:
    """The pieces of rows that all have one width (numbers, every varint one length) and their payload size, for
    up to _FIXED_ROWS rows, framed with no index arrays; None otherwise."""
    if 0 < num_rows <= _FIXED_ROWS:
        example = example_pieces(columns, num_rows)
        if all(piece.fixed is not None for piece in example):
            return example, int(total_lengths(example, 1)[0])
    return None


def _variable_tfrecords(columns: Mapping[str, ColumnLike], order: np.ndarray | None, num_rows: int) -> EncodedBatch:
    """`encode_tfrecords` for rows of varying width (or too many to frame at once), in slices of BATCH_ROWS."""
    if order is not None:
        columns = {name: _take(values, order) for name, values in columns.items()}
        num_rows = len(order)
    batches = []
    length_crcs: dict[int, bytes] = {}
    for start in range(0, max(num_rows, 1), BATCH_ROWS):
        stop = min(start + BATCH_ROWS, num_rows)
        rows = stop - start
        part = {name: slice_rows(values, start, stop) for name, values in columns.items()}
        example = example_pieces(part, rows)
        if rows and all(piece.fixed is not None for piece in example):
            batches.append(_fixed_tfrecords(example, rows, int(total_lengths(example, 1)[0])))
            continue
        sizes = total_lengths(example, rows)
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
        data, offsets = assemble([Piece(fixed=header), *example, Piece(fixed=footer)], rows)
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
    return concat_batches(batches)

