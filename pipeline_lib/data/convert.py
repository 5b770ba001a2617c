"""The conversion stage: `convert(data, output_root, storage_options) -> Manifest`, CSV/Parquet/JSONL/NPZ to TFRecords.

`convert` streams the source in chunks of `data.read_chunk_rows` rows, infers the schema from the first chunk,
handles missing feature values (`data.missing`), splits rows into train and eval by a hash of their values, adds
them to the statistics of their split, encodes them in bulk, and rolls shards over at `data.target_shard_mb`.
Shards are staged locally and published under their final names, then `schema.json` and `statistics.json`, then
`manifest.json` last: a set without a manifest is never complete, and a rerun replaces it.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from pipeline_lib.config import DataConfig, DataEngine, RayConfig
from pipeline_lib.core import storage
from pipeline_lib.core.events import ConversionProgress
from pipeline_lib.data.chunk_conversion import (
    ChunkWriter,
    ConversionPlan,
    check_rows,
    label_values,
    plan_conversion,
)
from pipeline_lib.data.manifest import DType, Manifest, SourceFingerprint
from pipeline_lib.data.missing import imputation
from pipeline_lib.data.progress import ConversionMeter
from pipeline_lib.data.publish import (
    Destination,
    create_staging_dir,
    publish,
    reusable_manifest,
)
from pipeline_lib.data.readers.base import RawChunk, read_ahead
from pipeline_lib.data.schema import build_schema
from pipeline_lib.data.shard_writer import shard_compression
from pipeline_lib.data.sources import (
    ListedFile,
    dataset_uri_for,
    fingerprint_of,
    list_source,
)

logger = logging.getLogger(__name__)


def convert(data: DataConfig, output_root: str, storage_options: dict[str, Any] | None = None, *,
            progress_fn: Callable[[ConversionProgress], None] | None = None,
            ray: RayConfig | None = None) -> Manifest:
    """Convert `data.source` to TFRecord shards under `<output_root>/data/<fingerprint>/` and return the Manifest.

    The source is read in chunks of `data.read_chunk_rows` rows (CSV and JSONL by lines, Parquet by record
    batches, NPZ by rows of each array), so memory stays bounded by the chunk, not the input. A rerun on an
    unchanged source with the same settings finds the manifest and returns it without writing anything. With
    `data.engine: ray` the files are converted by tasks on the Ray cluster of `ray` (train.ray; see `ray_engine`).

    Args:
        data: the data section of the pipeline config; `data.storage_options` are for the source.
        output_root: fsspec URI under which `data/<fingerprint>/` is written.
        storage_options: fsspec options for output_root.
        progress_fn: called with the rows converted and source bytes read, at most once a second while rows are
            converted, and once at 100 % when the manifest is published (also when an unchanged source's
            manifest is reused).
        ray: the config's train.ray section: the cluster `data.engine: ray` converts on.

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
    out = Destination(out_fs, dataset_path, dataset_uri)
    meter = ConversionMeter(progress_fn, sum(f.info.size for f in files))
    existing = reusable_manifest(out_fs, dataset_path, dataset_uri, storage_options, source)
    if existing is not None:
        logger.info("convert | reusing %s: the source and settings are unchanged (fingerprint %s)", dataset_uri,
                    fingerprint)
        meter.finish(rows=existing.num_records("train") + existing.num_records("eval"))
        return existing
    plan, first_chunks = plan_conversion(fs, files, data)
    if data.engine == DataEngine.RAY:
        first_chunks.close()
        from pipeline_lib.data.ray_engine import (
            convert_on_ray,  # Ray is imported only when a config asks for it
        )

        return convert_on_ray(data, plan, fs, files, source, out, meter, ray or RayConfig(),
                              storage_options=storage_options)
    try:
        return _convert_here(data, plan, fs, files, first_chunks, source, out, meter)
    finally:
        first_chunks.close()


def _convert_here(data: DataConfig, plan: ConversionPlan, fs, files: Sequence[ListedFile],
                  first_chunks: Iterator[RawChunk], source: SourceFingerprint, out: Destination,
                  meter: ConversionMeter) -> Manifest:
    """The local engine: every file in this process, shards staged, then published under their final names."""
    out_fs, dataset_path, dataset_uri = out.fs, out.path, out.uri
    label_type = plan.types[data.label]
    if label_type.dtype == DType.STRING:
        vocabulary: set[str] = set()
        for source_file in files:
            vocabulary |= label_values(fs, source_file, data, label_type)
        plan = dataclasses.replace(plan, vocabulary=sorted(vocabulary))
    logger.info("convert | %d file(s) from %s | columns: %s", len(files), data.source,
                ", ".join(f"{n}:{plan.types[n].describe()}" for n in plan.needed))

    staging_dir, local_out = create_staging_dir(out_fs, dataset_path, source.sha256[:16])
    writer = ChunkWriter(data, plan, staging_dir, durable=local_out)
    stats = writer.stats
    try:
        for index, source_file in enumerate(files):
            logger.info("convert | reading %s (%s, %d bytes)", source_file.uri, source_file.format.value,
                        source_file.info.size)
            # the chunks the schema came from are converted, not read a second time
            chunks = first_chunks if index == 0 else plan.chunks(fs, source_file, data)
            for chunk in read_ahead(chunks):
                writer.add(chunk, source_file.format)
                meter.chunk_done(chunk.num_rows, chunk.num_bytes, source_file.info.size)
            meter.file_done(source_file.info.size)
        staged = writer.close()
        check_rows(data, stats.num_rows["train"] + stats.num_rows["eval"], stats.bad.num_bad)
        schema = build_schema(data, plan.features, plan.types, plan.vocabulary, stats.label_max)
        statistics = stats.statistics.result(data.label)
        statistics = statistics.model_copy(
            update={"imputation": imputation(data, statistics, plan.features, plan.types)})
        manifest = publish(out_fs, dataset_path, dataset_uri, staged, schema, source, shard_compression(data),
                           stats.bad.num_bad, stats.record_layout, statistics)
    except BaseException:
        writer.abort()
        raise
    finally:
        writer.release()
        shutil.rmtree(staging_dir, ignore_errors=True)
    logger.info(
        "convert | rows: train %d, eval %d | shards: train %d, eval %d | bad rows: %d | %s",
        stats.num_rows["train"], stats.num_rows["eval"], len(manifest.shards_for("train")),
        len(manifest.shards_for("eval")), stats.bad.num_bad, dataset_uri,
    )
    meter.finish()
    return manifest
