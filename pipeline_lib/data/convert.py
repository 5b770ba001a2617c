"""The conversion stage: `convert(data, output_root, storage_options) -> Manifest`, CSV/Parquet/JSONL/NPZ to TFRecords.

`convert` streams the source in chunks of `data.read_chunk_rows` rows, infers the schema from the first chunk,
handles missing feature values (`data.missing`), splits rows into train and eval by a hash of their values, adds
them to the statistics of their split, encodes them in bulk, and rolls shards over at `data.target_shard_mb`.
Shards are staged locally and published under their final names, then `schema.json` and `statistics.json`, then
`manifest.json` last: a set without a manifest is never complete, and a rerun replaces it.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline_lib.config import Compression, DataConfig, DataFormat
from pipeline_lib.core import storage
from pipeline_lib.core.events import ConversionProgress
from pipeline_lib.data.accumulators import StatisticsBuilder
from pipeline_lib.data.bad_records import BadRecords
from pipeline_lib.data.coercion import Column, arrow_type, coerce, reader_type
from pipeline_lib.data.encoding import RECORD_BUFFERS
from pipeline_lib.data.errors import ConversionError
from pipeline_lib.data.framing import encode_tfrecord_parts
from pipeline_lib.data.manifest import DType, Manifest, RecordLayout
from pipeline_lib.data.missing import apply_missing, check_missing_columns, imputation
from pipeline_lib.data.progress import ConversionMeter
from pipeline_lib.data.publish import create_staging_dir, publish, reusable_manifest
from pipeline_lib.data.readers.base import RawChunk, prepend, read_ahead
from pipeline_lib.data.readers.registry import open_reader
from pipeline_lib.data.record_layout import record_layout
from pipeline_lib.data.schema import (
    ColumnType,
    build_schema,
    check_parse_dates,
    infer_types,
    select_columns,
)
from pipeline_lib.data.shard_writer import (
    SPLITS,
    WRITE_PART_BYTES,
    BackgroundWrites,
    RollingShards,
)
from pipeline_lib.data.sources import (
    ListedFile,
    dataset_uri_for,
    fingerprint_of,
    list_source,
)
from pipeline_lib.data.split import eval_mask, hashed_columns, split_hash

logger = logging.getLogger(__name__)


@dataclass
class _Stats:
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


def _scan_vocabulary(fs, files: Sequence[ListedFile], data: DataConfig, label_type: ColumnType) -> list[str]:
    """A first pass over the label column only: the sorted distinct string labels."""
    values: set[str] = set()
    for source in files:
        reader = open_reader(fs, source, data)
        reader.use_types({data.label: arrow_type(label_type)})
        for chunk in reader.chunks([data.label], data.read_chunk_rows):
            column = coerce(chunk.columns[data.label], label_type, source.format)
            good = column.values.filter(pa.array(~column.bad)) if column.bad.any() else column.values
            values.update(v.decode("utf-8", "surrogateescape") for v in pc.unique(good).to_pylist())
    values.discard("")  # an empty label is missing: a bad record, not a class
    return sorted(values)


def convert(data: DataConfig, output_root: str, storage_options: dict[str, Any] | None = None, *,
            progress_fn: Callable[[ConversionProgress], None] | None = None) -> Manifest:
    """Convert `data.source` to TFRecord shards under `<output_root>/data/<fingerprint>/` and return the Manifest.

    The source is read in chunks of `data.read_chunk_rows` rows (CSV and JSONL by lines, Parquet by record
    batches, NPZ by rows of each array), so memory stays bounded by the chunk, not the input. A rerun on an
    unchanged source with the same settings finds the manifest and returns it without writing anything.

    Args:
        data: the data section of the pipeline config; `data.storage_options` are for the source.
        output_root: fsspec URI under which `data/<fingerprint>/` is written.
        storage_options: fsspec options for output_root.
        progress_fn: called with the rows converted and source bytes read, at most once a second while rows are
            converted, and once at 100 % when the manifest is published (also when an unchanged source's
            manifest is reused).

    Returns:
        The manifest: shards with records, bytes and digest (BLAKE3), the schema and the source fingerprint.

    Raises:
        ConversionError: when the source matches no files, a column is unknown, a type cannot be inferred, or
            (with `on_bad_record: fail`) a row holds a bad value: the message names file, line, column and value.
        StorageUnavailable: when the source or output storage does not answer (the stage may be retried; the
            retry removes the partial shard set). Other I/O errors (a full local disk) pass through unchanged.
    """
    fs, files = list_source(data)
    source = fingerprint_of(data, files)
    fingerprint = source.sha256[:16]
    dataset_uri = dataset_uri_for(output_root, fingerprint)
    out_fs, dataset_path = storage.get_fs(dataset_uri, storage_options)
    meter = ConversionMeter(progress_fn, sum(f.info.size for f in files))
    existing = reusable_manifest(out_fs, dataset_path, dataset_uri, storage_options, source)
    if existing is not None:
        logger.info("convert | reusing %s: the source and settings are unchanged (fingerprint %s)", dataset_uri,
                    fingerprint)
        meter.finish(rows=existing.num_records("train") + existing.num_records("eval"))
        return existing

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
        raise ConversionError(f"data.label {data.label!r} holds {label_type.describe()} values; the label "
                              "must be one number or string per row")
    # The CSV reader parses the chunks still to come straight to these types (dates and timestamps: as text).
    parse_types = {name: reader_type(types[name]) for name in needed if not types[name].shape}
    first_reader.use_types(parse_types)
    vocabulary = None
    if label_type.dtype == DType.STRING:
        vocabulary = _scan_vocabulary(fs, files, data, label_type)
    logger.info("convert | %d file(s) from %s | columns: %s", len(files), data.source,
                ", ".join(f"{n}:{types[n].describe()}" for n in needed))

    staging_dir, local_out = create_staging_dir(out_fs, dataset_path, fingerprint)
    compression = "gzip" if data.compression == Compression.GZIP else "none"
    target_bytes = int(data.target_shard_mb * 1024 * 1024)
    # Local output is published by renaming the staged files, so they are fsynced as each shard closes (on the
    # closer thread, beside the next shard's writes); remote output is uploaded from staging, which is durable.
    stats = _Stats(bad=BadRecords(data.on_bad_record),
                   statistics=StatisticsBuilder({n: types[n].dtype for n in [*features, data.label]}, SPLITS))
    writes = BackgroundWrites()
    shards = {s: RollingShards(s, staging_dir, compression, target_bytes, durable=local_out, closer=writes.closer,
                               hasher=writes.hasher, compression_level=data.compression_level,
                               compressor=writes.compressor, device=writes.device)
              for s in SPLITS}
    try:
        for index, source_file in enumerate(files):
            logger.info("convert | reading %s (%s, %d bytes)", source_file.uri, source_file.format.value,
                        source_file.info.size)
            if index == 0:  # the chunk the schema came from is converted, not read a second time
                chunks = prepend(first_chunk, first_chunks)
            else:
                reader = open_reader(fs, source_file, data)
                reader.use_types(parse_types)
                chunks = reader.chunks(needed, data.read_chunk_rows)
            for chunk in read_ahead(chunks):
                _convert_chunk(chunk, source_file.format, data, features, types, vocabulary, shards, writes,
                               stats)
                meter.chunk_done(chunk.num_rows, chunk.num_bytes, source_file.info.size)
            meter.file_done(source_file.info.size)
        writes.wait()
        staged = [shard for s in SPLITS for shard in shards[s].close()]
        if stats.num_rows["train"] + stats.num_rows["eval"] == 0:
            raise ConversionError(
                f"data.source {data.source!r} produced no rows ({stats.bad.num_bad} bad); check the files"
                + (" and on_bad_record" if stats.bad.num_bad else "")
            )
        schema = build_schema(data, features, types, vocabulary, stats.label_max)
        statistics = stats.statistics.result(data.label)
        statistics = statistics.model_copy(update={"imputation": imputation(data, statistics, features, types)})
        manifest = publish(out_fs, dataset_path, dataset_uri, staged, schema, source, compression,
                           stats.bad.num_bad, stats.record_layout, statistics)
    except BaseException:
        with contextlib.suppress(BaseException):
            writes.wait()
        for writer in shards.values():
            writer.abort()
        raise
    finally:
        first_chunks.close()
        writes.close()
        RECORD_BUFFERS.clear()
        stats.statistics.close()
        shutil.rmtree(staging_dir, ignore_errors=True)
    logger.info(
        "convert | rows: train %d, eval %d | shards: train %d, eval %d | bad rows: %d | %s",
        stats.num_rows["train"], stats.num_rows["eval"], len(manifest.shards_for("train")),
        len(manifest.shards_for("eval")), stats.bad.num_bad, dataset_uri,
    )
    meter.finish()
    return manifest


def _convert_chunk(chunk: RawChunk, fmt: DataFormat, data: DataConfig, features: list[str],
                   types: dict[str, ColumnType], vocabulary: list[str] | None,
                   shards: dict[str, RollingShards], writes: BackgroundWrites, stats: _Stats) -> None:
    """Coerce, check, split and encode one chunk, and queue its records for the shard writers."""
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

