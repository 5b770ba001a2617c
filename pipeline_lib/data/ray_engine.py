"""The Ray engine (`data.engine: ray`): conversion as plain Ray tasks on the cluster of train.ray.address.

The driver (the flow's process) lists the source, infers the plan from the first chunk, and splits the work into
units: one per source file, and one per run of row groups of a large Parquet file. The label vocabulary is
collected by one task per file. Each unit's task opens its file on its node with tfdag's own reader, converts it
with the local engine's chunk writer (`chunk_conversion`: the same split hash, encoder and statistics), writes its
shards straight to the dataset under deterministic names, and returns their records and digests, its partial
statistics and bad-record count. The driver merges the statistics and writes schema.json, statistics.json and the
manifest last.

The train and eval records are exactly the local engine's, in the same order (unit by unit, in source order); the
shards are laid out per unit, so the engine is part of the dataset's fingerprint. A task whose node is lost is
retried (TASK_RETRIES), and rewrites the same shards; a failure removes what the tasks wrote, so a dataset
directory never holds a half-written set, and names the file, the line and the node.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow.parquet as pq

from pipeline_lib.cluster.ray_connect import (
    connect,
    node_name,
    on_this_node,
    ray_module,
    resource_options,
    task_error,
)
from pipeline_lib.config import DataConfig, DataFormat, RayConfig
from pipeline_lib.core import storage
from pipeline_lib.data.bad_records import MAX_BAD_SAMPLES
from pipeline_lib.data.chunk_conversion import (
    ChunkWriter,
    ConversionPlan,
    check_rows,
    label_values,
)
from pipeline_lib.data.errors import ConversionError
from pipeline_lib.data.manifest import (
    DType,
    Manifest,
    RecordLayout,
    ShardInfo,
    SourceFingerprint,
)
from pipeline_lib.data.missing import imputation
from pipeline_lib.data.progress import ConversionMeter
from pipeline_lib.data.publish import (
    Destination,
    is_local_fs,
    path_join,
    place_shard,
    write_metadata,
)
from pipeline_lib.data.readers.base import read_ahead
from pipeline_lib.data.schema import build_schema
from pipeline_lib.data.shard_writer import SPLITS, shard_compression
from pipeline_lib.data.sources import ListedFile
from pipeline_lib.data.statistics import DatasetStatistics, merge_statistics

logger = logging.getLogger(__name__)

ENGINE = "ray"
TASK_RETRIES = 3  # a task whose worker or node dies is run again this many times (Ray's max_retries)
# How long a failed conversion waits for the tasks it cancelled to end (Ray cancels asynchronously: a task still
# running may place a shard after the cancel returns) before it removes what they wrote.
CANCELLED_WAIT_S = 60.0
# A Parquet file is split into units of consecutive row groups holding at least this much (uncompressed) each.
UNIT_BYTES = 64 << 20


@dataclass(frozen=True)
class WorkUnit:
    """One task's share of the source: a file, or a run of its Parquet row groups."""

    index: int
    file: ListedFile
    row_groups: range | None = None  # None: the whole file
    num_bytes: int = 0  # of the source file read (its share, for row groups)

    def describe(self) -> str:
        if self.row_groups is None:
            return self.file.uri
        return f"{self.file.uri} (row groups {self.row_groups.start}-{self.row_groups.stop - 1})"


@dataclass
class UnitResult:
    """What a unit's task wrote and counted."""

    index: int
    shards: list[ShardInfo]
    statistics: DatasetStatistics
    num_rows: dict[str, int]
    num_bad: int
    bad_samples: list[str]
    label_max: int | None
    layouts: list[RecordLayout | None]
    node: str


def work_units(fs, files: Sequence[ListedFile], unit_bytes: int | None = None) -> list[WorkUnit]:
    """One unit per file; a Parquet file of several row groups holding more than `unit_bytes`, one per run of its
    row groups that holds at least `unit_bytes` (CSV and JSONL are split per file: a byte range would need a scan
    of the quotes from the file's start)."""
    unit_bytes = unit_bytes or UNIT_BYTES
    units: list[WorkUnit] = []
    for source in files:
        runs = _row_group_runs(fs, source, unit_bytes) if source.format == DataFormat.PARQUET else None
        if not runs:
            units.append(WorkUnit(len(units), source, None, source.info.size))
            continue
        total = sum(size for _, size in runs)
        for groups, size in runs:
            units.append(WorkUnit(len(units), source, groups, source.info.size * size // max(total, 1)))
    return units


def _row_group_runs(fs, source: ListedFile, unit_bytes: int) -> list[tuple[range, int]] | None:
    """Runs of consecutive row groups of at least `unit_bytes` each (the last may hold less), or None for one unit."""
    with fs.open(source.path, "rb") as handle:
        metadata = pq.ParquetFile(handle).metadata
    sizes = [metadata.row_group(g).total_byte_size for g in range(metadata.num_row_groups)]
    if len(sizes) < 2 or sum(sizes) <= unit_bytes:
        return None
    runs, start, held = [], 0, 0
    for group, size in enumerate(sizes):
        held += size
        if held >= unit_bytes:
            runs.append((range(start, group + 1), held))
            start, held = group + 1, 0
    if start < len(sizes):
        runs.append((range(start, len(sizes)), held))
    return runs


def convert_on_ray(data: DataConfig, plan: ConversionPlan, fs, files: Sequence[ListedFile],
                   source: SourceFingerprint, out: Destination, meter: ConversionMeter, ray_config: RayConfig, *,
                   storage_options: dict[str, Any] | None) -> Manifest:
    """Convert `files` with tasks on the Ray cluster of `ray_config`, and publish the set at `out` (see the module).

    Raises:
        RayClusterError: no Ray cluster answers at train.ray.address (or RAY_ADDRESS).
        ConversionError: a bad record (with its file, line and node), or a unit Ray lost more than TASK_RETRIES
            times.
    """
    ray = ray_module()
    connect(ray_config)
    # ${VAR}s in the storage options are expanded here, where they are set; the tasks get the values as arguments.
    data = data.model_copy(update={"storage_options": storage.expand_env(dict(data.storage_options))})
    out_options = storage.expand_env(dict(storage_options or {}))
    options = {**resource_options(data.ray_resources), "runtime_env": ray_config.runtime_env or None,
               "max_retries": TASK_RETRIES}
    units = work_units(fs, files)
    label_type = plan.types[data.label]
    if label_type.dtype == DType.STRING:
        scan = ray.remote(label_values_of).options(**options)
        vocabulary: set[str] = set()
        for values in _gather(ray, {scan.remote(data, f, label_type): WorkUnit(i, f) for i, f in enumerate(files)}):
            vocabulary |= values
        plan = dataclasses.replace(plan, vocabulary=sorted(vocabulary))
    logger.info("convert | %d file(s) from %s in %d task(s) on Ray | columns: %s", len(files), data.source,
                len(units), ", ".join(f"{n}:{plan.types[n].describe()}" for n in plan.needed))
    if out.fs.exists(out.path):
        logger.info("convert | removing the incomplete shard set at %s (no manifest) before writing", out.uri)
        out.fs.rm(out.path, recursive=True)
    task = ray.remote(convert_unit).options(**options)
    refs = {task.remote(data, plan, unit, len(units), out.uri, out_options, source.sha256[:16]): unit
            for unit in units}
    gathered = _gather(ray, refs)
    try:
        results = []
        for result in gathered:
            results.append(result)
            meter.chunk_done(sum(result.num_rows.values()) + result.num_bad, None, 0)
            meter.file_done(units[result.index].num_bytes)
        manifest = _publish(data, plan, source, out, sorted(results, key=lambda r: r.index))
    except BaseException:
        gathered.close()  # the tasks it cancelled have ended: none writes after the removal below
        if out.fs.exists(out.path):  # what the tasks wrote is no dataset without its manifest
            out.fs.rm(out.path, recursive=True)
        raise
    finally:
        _remove_staging(out, source.sha256[:16])
    meter.finish()
    return manifest


def _remove_staging(out: Destination, fingerprint: str) -> None:
    """The staging directories beside a local dataset that tasks lost with their node left behind."""
    if not is_local_fs(out.fs):
        return
    parent = os.path.dirname(out.path)
    for name in os.listdir(parent) if os.path.isdir(parent) else []:
        if name.startswith(f".staging-{fingerprint}-unit"):
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)


def _gather(ray, refs: dict[Any, WorkUnit]):
    """Each task's result as it finishes; the first failure cancels the rest, waits until they have ended (so that
    none writes after the caller cleans up), and is raised (its cause, for ours)."""
    pending = dict(refs)
    try:
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            for ref in done:
                unit = pending.pop(ref)
                try:
                    yield ray.get(ref)
                except ray.exceptions.RayTaskError as error:
                    raise task_error(error) from None
                except ray.exceptions.RayError as error:
                    raise ConversionError(
                        f"Ray lost the conversion of {unit.describe()} in each of {TASK_RETRIES + 1} attempt(s) "
                        f"({type(error).__name__}: {str(error).splitlines()[0]}); check the cluster's nodes "
                        "(`ray status`) and convert again") from None
    finally:
        for ref in pending:
            ray.cancel(ref, force=True)
        if pending:
            _, running = ray.wait(list(pending), num_returns=len(pending), timeout=CANCELLED_WAIT_S)
            if running:
                logger.warning("convert | %d cancelled Ray task(s) still running after %g s: what they write later "
                               "is left at the dataset's path, without a manifest", len(running), CANCELLED_WAIT_S)


def _publish(data: DataConfig, plan: ConversionPlan, source: SourceFingerprint, out: Destination,
             results: list[UnitResult]) -> Manifest:
    num_rows = {s: sum(r.num_rows[s] for r in results) for s in SPLITS}
    num_bad = sum(r.num_bad for r in results)
    for sample in [s for r in results for s in r.bad_samples][:MAX_BAD_SAMPLES]:
        logger.warning("convert | skipped bad record: %s", sample)
    check_rows(data, num_rows["train"] + num_rows["eval"], num_bad)
    shards = _kept_shards(out, [s for r in results for s in r.shards])
    _check_written(out, shards)
    label_max = max((r.label_max for r in results if r.label_max is not None), default=None)
    layouts = {layout for r in results for layout in r.layouts}
    schema = build_schema(data, plan.features, plan.types, plan.vocabulary, label_max)
    statistics = merge_statistics([r.statistics for r in results])
    statistics = statistics.model_copy(update={"imputation": imputation(data, statistics, plan.features, plan.types)})
    nodes: dict[str, int] = {}
    for result in results:
        written = sum(1 for s in result.shards if s in shards)
        if written:
            nodes[result.node] = nodes.get(result.node, 0) + written
    if is_local_fs(out.fs):
        for split in SPLITS:
            storage.fsync_dir(os.path.join(out.path, split))
    manifest = write_metadata(out, shards, schema, source, shard_compression(data), num_bad,
                              next(iter(layouts)) if len(layouts) == 1 else None, statistics, engine=ENGINE,
                              nodes=nodes)
    logger.info("convert | rows: train %d, eval %d | shards: train %d, eval %d | bad rows: %d | nodes: %s | %s",
                num_rows["train"], num_rows["eval"], len(manifest.shards_for("train")),
                len(manifest.shards_for("eval")), num_bad, nodes, out.uri)
    return manifest


def _kept_shards(out: Destination, shards: list[ShardInfo]) -> list[ShardInfo]:
    """Every shard with records, in split and unit order; a split without records keeps one empty shard."""
    kept = []
    for split in SPLITS:
        of_split = [s for s in shards if s.split == split]
        full = [s for s in of_split if s.num_records]
        kept += full or of_split[:1]
        for empty in (s for s in of_split if s not in kept):
            out.fs.rm(path_join(out.fs)(out.path, empty.path))
    return kept


def _check_written(out: Destination, shards: list[ShardInfo]) -> None:
    """Every shard the manifest will name is in place with its size (a task lost mid-upload was rerun whole)."""
    listing = out.fs.find(out.path, detail=True)
    sizes = {path.split("://", 1)[-1].lstrip("/"): int(info.get("size") or 0) for path, info in listing.items()}
    root = out.path.split("://", 1)[-1].lstrip("/").rstrip("/")
    for shard in shards:
        found = sizes.get(f"{root}/{shard.path}")
        if found != shard.num_bytes:
            raise ConversionError(f"shard {shard.path} of {out.uri} holds {found} bytes, not the {shard.num_bytes} "
                                  "its task wrote; the output storage lost a write: convert again")


# --- what runs in the tasks, on the cluster's nodes --------------------------------------------------------------


def label_values_of(data: DataConfig, source: ListedFile, label_type) -> set[str]:
    """A file's share of the label vocabulary (a task)."""
    fs, _ = storage.get_fs(data.source, data.storage_options)
    try:
        return label_values(fs, source, data, label_type)
    except ConversionError as error:
        raise on_this_node(error) from None


def convert_unit(data: DataConfig, plan: ConversionPlan, unit: WorkUnit, num_units: int, dataset_uri: str,
                 storage_options: dict[str, Any], fingerprint: str) -> UnitResult:
    """Convert one unit into shards `<split>/part-<unit>-<n>-of-<units>` of the dataset (a task)."""
    fs, _ = storage.get_fs(data.source, data.storage_options)
    out_fs, dataset_path = storage.get_fs(dataset_uri, storage_options)
    local_out = is_local_fs(out_fs)
    if local_out:  # staged beside the dataset, so that placing a shard is a rename
        os.makedirs(os.path.dirname(dataset_path), exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".staging-{fingerprint}-unit{unit.index:05d}-",
                               dir=os.path.dirname(dataset_path) if local_out else None)
    writer = ChunkWriter(data, plan, staging, durable=local_out)
    stats = writer.stats
    try:
        try:
            for chunk in read_ahead(plan.chunks(fs, unit.file, data, unit.row_groups)):
                writer.add(chunk, unit.file.format)
            staged = writer.close()
            statistics = stats.statistics.result(data.label)
        except ConversionError as error:
            writer.abort()
            raise on_this_node(error) from None
        except BaseException:
            writer.abort()
            raise
        finally:
            writer.release()
        suffix = ".tfrecord.gz" if shard_compression(data) == "gzip" else ".tfrecord"
        shards = []
        for split in SPLITS:
            for number, shard in enumerate(s for s in staged if s.split == split):
                relative = f"{split}/part-{unit.index:05d}-{number:03d}-of-{num_units:05d}{suffix}"
                place_shard(out_fs, shard.local_path, path_join(out_fs)(dataset_path, relative))
                shards.append(ShardInfo(split=split, path=relative, num_records=shard.num_records,
                                        num_bytes=shard.num_bytes, digest=shard.digest))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return UnitResult(index=unit.index, shards=shards, statistics=statistics,
                      num_rows=dict(stats.num_rows), num_bad=stats.bad.num_bad, bad_samples=list(stats.bad.samples),
                      label_max=stats.label_max, layouts=list(stats.layouts), node=node_name())
