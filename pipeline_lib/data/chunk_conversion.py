"""Converting chunks, what both engines share: the plan the first chunk decides (columns, types, the label
vocabulary), and the writer that turns chunks into staged shards per split with their statistics and bad records."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline_lib.config import DataConfig, DataFormat
from pipeline_lib.data.accumulators import StatisticsBuilder
from pipeline_lib.data.bad_records import BadRecords
from pipeline_lib.data.coercion import Column, arrow_type, coerce, reader_type
from pipeline_lib.data.encoding import RECORD_BUFFERS
from pipeline_lib.data.errors import ConversionError
from pipeline_lib.data.framing import encode_tfrecord_parts
from pipeline_lib.data.manifest import DType, RecordLayout
from pipeline_lib.data.missing import apply_missing, check_missing_columns
from pipeline_lib.data.readers.base import RawChunk, prepend
from pipeline_lib.data.readers.registry import open_reader
from pipeline_lib.data.record_layout import record_layout
from pipeline_lib.data.schema import (
    ColumnType,
    check_parse_dates,
    infer_types,
    select_columns,
)
from pipeline_lib.data.shard_writer import (
    SPLITS,
    WRITE_PART_BYTES,
    BackgroundWrites,
    RollingShards,
    StagedShard,
    shard_compression,
)
from pipeline_lib.data.sources import ListedFile
from pipeline_lib.data.split import eval_mask, hashed_columns, split_hash


@dataclass
class ChunkStats:
    """What the chunks converted so far add up to: rows per split, bad records, the label range, record layouts."""

    bad: BadRecords
    statistics: StatisticsBuilder
    num_rows: dict[str, int] = field(default_factory=lambda: {s: 0 for s in SPLITS})
    label_max: int | None = None  # integer labels: the largest seen
    layouts: set[RecordLayout | None] = field(default_factory=set)  # each chunk's record_layout (None: rows of varying shape)

    @property
    def record_layout(self) -> RecordLayout | None:
        """The byte layout of every record written, if all chunks had the same one."""
        return next(iter(self.layouts)) if len(self.layouts) == 1 else None


@dataclass(frozen=True)
class ConversionPlan:
    """What the first chunk of the first file decided, and every file's conversion follows: the feature columns,
    the columns read, their types, and the sorted label vocabulary (string labels)."""

    features: list[str]
    needed: list[str]
    types: dict[str, ColumnType]
    vocabulary: list[str] | None = None

    @property
    def parse_types(self) -> dict[str, pa.DataType]:
        """The types the CSV reader parses the columns to (dates and timestamps: as text)."""
        return {name: reader_type(self.types[name]) for name in self.needed if not self.types[name].shape}

    def chunks(self, fs, source: ListedFile, data: DataConfig, row_groups: range | None = None) -> Iterator[RawChunk]:
        """The chunks of `source` (of these Parquet row groups only, when given), read as this plan says."""
        reader = open_reader(fs, source, data)
        reader.use_types(self.parse_types)
        if row_groups is not None:
            reader.select_row_groups(row_groups)
        return reader.chunks(self.needed, data.read_chunk_rows)


def plan_conversion(fs, files: Sequence[ListedFile], data: DataConfig) -> tuple[ConversionPlan, Iterator[RawChunk]]:
    """The plan inferred from the first chunk of `files[0]`, and that file's chunks (the first one included).

    Raises:
        ConversionError: a column is unknown or its type cannot be inferred, the first file has no rows, or the
            label is not one number or string per row.
    """
    first_reader = open_reader(fs, files[0], data)
    features, needed = select_columns(data, files[0].uri, first_reader.available_columns())
    check_missing_columns(data, features, files[0].uri)
    check_parse_dates(data, features, files[0].uri)
    first_reader.guess_number_types()
    first_chunks = first_reader.chunks(needed, data.read_chunk_rows)
    first_chunk = next(first_chunks, None)
    if first_chunk is None or first_chunk.num_rows == 0:
        first_chunks.close()
        raise ConversionError(
            f"{files[0].uri} has no data rows in its first {data.read_chunk_rows} lines or rows; the schema is "
            "inferred from the first chunk, so the first file needs data"
        )
    types = infer_types(first_chunk, files[0].format, data.parse_dates)
    label_type = types[data.label]
    if label_type.shape or label_type.time is not None:
        first_chunks.close()
        raise ConversionError(f"data.label {data.label!r} holds {label_type.describe()} values; the label "
                              "must be one number or string per row")
    plan = ConversionPlan(features, needed, types)
    # The CSV reader parses the chunks still to come straight to these types (dates and timestamps: as text).
    first_reader.use_types(plan.parse_types)
    return plan, prepend(first_chunk, first_chunks)


def label_values(fs, source: ListedFile, data: DataConfig, label_type: ColumnType) -> set[str]:
    """The distinct non-empty string labels of one file: its share of the label vocabulary."""
    values: set[str] = set()
    reader = open_reader(fs, source, data)
    reader.use_types({data.label: arrow_type(label_type)})
    for chunk in reader.chunks([data.label], data.read_chunk_rows):
        column = coerce(chunk.columns[data.label], label_type, source.format)
        good = column.values.filter(pa.array(~column.bad)) if column.bad.any() else column.values
        values.update(v.decode("utf-8", "surrogateescape") for v in pc.unique(good).to_pylist())
    values.discard("")  # an empty label is missing: a bad record, not a class
    return values


class ChunkWriter:
    """Converts chunks into one set of rolling shards per split in a staging directory, with their statistics.

    `close` returns the staged shards once every write is durable; `abort` drops them. `release` (always, last)
    stops the writer's threads.
    """

    def __init__(self, data: DataConfig, plan: ConversionPlan, staging_dir: str, *, durable: bool):
        self.data, self.plan = data, plan
        compression = shard_compression(data)
        self.stats = ChunkStats(bad=BadRecords(data.on_bad_record),
                            statistics=StatisticsBuilder({n: plan.types[n].dtype for n in [*plan.features, data.label]},
                                                         SPLITS))
        # Local output is published by renaming the staged files, so they are fsynced as each shard closes (on the
        # closer thread, beside the next shard's writes); remote output is uploaded from staging, which is durable.
        self.writes = BackgroundWrites()
        target_bytes = int(data.target_shard_mb * 1024 * 1024)
        self.shards = {s: RollingShards(s, staging_dir, compression, target_bytes, durable=durable,
                                        closer=self.writes.closer, hasher=self.writes.hasher,
                                        compression_level=data.compression_level, compressor=self.writes.compressor,
                                        device=self.writes.device)
                       for s in SPLITS}

    def add(self, chunk: RawChunk, fmt: DataFormat) -> None:
        _convert_chunk(chunk, fmt, self.data, self.plan, self.shards, self.writes, self.stats)

    def close(self) -> list[StagedShard]:
        self.writes.wait()
        return [shard for s in SPLITS for shard in self.shards[s].close()]

    def abort(self) -> None:
        with contextlib.suppress(BaseException):
            self.writes.wait()
        for writer in self.shards.values():
            writer.abort()

    def release(self) -> None:
        self.writes.close()
        RECORD_BUFFERS.clear()
        self.stats.statistics.close()


def check_rows(data: DataConfig, num_rows: int, num_bad: int) -> None:
    """Raise when the whole source gave no rows."""
    if num_rows == 0:
        raise ConversionError(
            f"data.source {data.source!r} produced no rows ({num_bad} bad); check the files"
            + (" and on_bad_record" if num_bad else "")
        )


def _convert_chunk(chunk: RawChunk, fmt: DataFormat, data: DataConfig, plan: ConversionPlan,
                   shards: dict[str, RollingShards], writes: BackgroundWrites, stats: ChunkStats) -> None:
    """Coerce, check, split and encode one chunk, and queue its records for the shard writers."""
    features, types, vocabulary = plan.features, plan.types, plan.vocabulary
    columns = {name: coerce(chunk.columns[name], types[name], fmt) for name in chunk.columns}
    label = columns[data.label]
    if types[data.label].dtype == DType.INT64:
        negative = np.flatnonzero((label.values < 0) & ~label.bad)
        for row in negative.tolist():
            label.bad[row] = True
            label.reasons[row] = (int(label.values[row]), "is a negative class label; classification labels are 0..n-1")
    missing = apply_missing(data, types, columns, chunk.num_rows)
    bad = np.zeros(chunk.num_rows, dtype=bool)
    for column in columns.values():
        bad |= column.bad
    if bad.any() or chunk.structural:
        stats.bad.handle(chunk, columns, bad, missing.fail, missing.skip)
    keep = ~bad
    if not keep.all():
        mask = pa.array(keep)
        columns = {
            name: Column(c.values[keep] if isinstance(c.values, np.ndarray) else c.values.filter(mask), c.bad[keep], {})
            for name, c in columns.items()
        }
    num_rows = int(keep.sum())
    if num_rows == 0:
        return
    values = {name: c.values for name, c in columns.items()}
    label_values = values[data.label]
    if vocabulary is not None:
        index = pc.index_in(label_values, value_set=pa.array([v.encode() for v in vocabulary], pa.binary()))
        if index.null_count:
            unknown = pc.filter(label_values, index.is_null())[0].as_py()
            raise ConversionError(
                f"{chunk.uri}: label {unknown!r} was not seen when the label vocabulary was collected; the source "
                "changed during conversion, rerun it"
            )
        encoded_label = index.to_numpy(zero_copy_only=False).astype(np.int64)
    else:
        encoded_label = label_values
    if types[data.label].dtype == DType.INT64:
        high = int(label_values.max())
        stats.label_max = high if stats.label_max is None else max(stats.label_max, high)

    hashes = split_hash({name: values[name] for name in hashed_columns(data.split, features, data.label)},
                        data.split.seed)
    to_eval = eval_mask(hashes, data.split.eval_fraction)
    # Encoded eval rows first, then train rows (each in source order): the split costs no copy of the records.
    eval_rows = np.flatnonzero(to_eval)
    stats.statistics.submit({name: values[name] for name in [*features, data.label]}, to_eval, len(eval_rows))
    order = np.concatenate([eval_rows, np.flatnonzero(~to_eval)])
    encoded = {**{name: values[name] for name in features}, data.label: encoded_label}
    stats.layouts.add(record_layout(encoded))
    num_eval, first = len(eval_rows), 0
    for batch in encode_tfrecord_parts(encoded, order, WRITE_PART_BYTES):
        writes.submit(shards, batch, min(max(num_eval - first, 0), len(batch)))
        first += len(batch)
    stats.num_rows["eval"] += num_eval
    stats.num_rows["train"] += num_rows - num_eval
