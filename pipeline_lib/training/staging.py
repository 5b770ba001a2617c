"""Per-worker staging: a verified local cache of the TFRecord shards a worker's ShardPlan assigns it.

TensorFlow's own file system no longer reads `s3://` (or `gs://`, `az://`, `memory://`), and every worker
downloading every shard wastes the network, so before training each worker copies only its files to a
local cache through fsspec, checks each against the manifest's digest (sha256 or BLAKE3, as it names), and hands
tf.data a manifest whose `dataset_uri` is that local directory. A file already in the cache is reused once it
verifies. A local dataset needs no staging: its files are read in place.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
from collections.abc import Iterable, Iterator
from typing import Any

from pydantic import BaseModel, ConfigDict

from pipeline_lib.cluster.info import ClusterInfo
from pipeline_lib.core import digests, retry, storage
from pipeline_lib.core.download import ChecksumMismatch, download_verified
from pipeline_lib.core.paths import default_cache_dir
from pipeline_lib.data.manifest import Manifest, ShardInfo
from pipeline_lib.data.statistics import STATISTICS_NAME
from pipeline_lib.planning.sharding import AutoShardPolicy, ShardPlan

logger = logging.getLogger(__name__)

DATASETS_DIR = "datasets"


class StagingError(storage.StorageError):
    """A shard cannot be staged: missing, unreadable or not matching the manifest; names the URI and the fix."""


class StageReport(BaseModel):
    """What one staging call did: where the files are, which were downloaded and which reused."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    local_dir: str
    downloaded: tuple[str, ...]  # manifest-relative shard paths fetched now
    reused: tuple[str, ...]  # already in the cache and verified
    num_bytes_downloaded: int


def needs_staging(manifest: Manifest) -> bool:
    """True when the dataset lives where TensorFlow cannot read it (any fsspec URI but a local path)."""
    return not storage.is_local(manifest.dataset_uri)


def dataset_cache_dir(manifest: Manifest, cache_dir: str | None = None) -> str:
    """The local directory a dataset's shards are staged to: `<cache>/datasets/<fingerprint>-<content>`.

    Keyed by the content hash (schema and every shard's digest), so two datasets never share a file by name
    alone and a reconverted dataset gets a fresh directory.
    """
    root = cache_dir or default_cache_dir()
    return os.path.join(root, DATASETS_DIR, f"{manifest.fingerprint[:16]}-{manifest.content_hash()[:16]}")


def localize_manifest(manifest: Manifest, local_dir: str) -> Manifest:
    """The same manifest with `dataset_uri` pointing at a local directory (shard paths stay relative)."""
    return manifest.model_copy(update={"dataset_uri": local_dir})


def files_for_worker(manifest: Manifest, plan: ShardPlan | None, worker_index: int, *,
                     include_eval: bool = False) -> tuple[str, ...]:
    """The manifest-relative shard paths one worker reads.

    FILE policy: the worker's own train files; DATA policy (or no plan): every train file. With
    `include_eval`, every eval shard too (the chief evaluates at each checkpoint).

    Raises:
        StagingError: when `worker_index` is not a worker of the plan.
    """
    if plan is None or plan.policy == AutoShardPolicy.DATA:
        files = [s.path for s in manifest.shards_for("train")]
    else:
        if not 0 <= worker_index < len(plan.assignments):
            raise StagingError(
                f"worker index {worker_index} is not in the shard plan's {len(plan.assignments)} assignment(s); "
                "re-plan the shards for this cluster (train.workers)"
            )
        files = list(plan.files_for(worker_index))
    if include_eval:
        files += [s.path for s in manifest.shards_for("eval")]
    return tuple(dict.fromkeys(files))


@contextlib.contextmanager
def _file_lock(path: str) -> Iterator[None]:
    """An exclusive lock beside `path`, so workers on one host download a shared shard once."""
    with open(path + ".lock", "a+b") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _is_verified(path: str, shard: ShardInfo, algorithm: digests.DigestAlgorithm) -> bool:
    try:
        if os.path.getsize(path) != shard.num_bytes:
            return False
    except OSError:
        return False
    return digests.local_file_digest(path, algorithm) == shard.digest


def _fetch_shard(fs, remote_path: str, local_path: str, shard: ShardInfo, algorithm: digests.DigestAlgorithm,
                 uri: str, retries: int) -> int:
    """Download one shard, verified, under the storage retry policy (a missing, refused or mismatching shard is
    permanent)."""
    try:
        return retry.STORAGE_RETRY.call(
            lambda: download_verified(fs, remote_path, local_path, shard.digest, algorithm), f"staging {uri}",
            retries=retries)
    except FileNotFoundError as error:
        raise StagingError(
            f"shard {uri} listed in the manifest of the dataset does not exist; the dataset is incomplete "
            "or was deleted: convert the data again"
        ) from error
    except PermissionError as error:
        raise StagingError(
            f"reading shard {uri} was refused ({error}); check the credentials for output_root (the "
            "environment, or storage_options in the config)"
        ) from error
    except ChecksumMismatch as error:
        raise StagingError(
            f"shard {uri} has {error.algorithm} {error.digest[:12]}… ({error.num_bytes} bytes) but its manifest "
            f"records {shard.digest[:12]}… ({shard.num_bytes} bytes); the dataset changed after conversion: convert "
            "the data again (a new output_root/data/<fingerprint>) rather than editing shards in place"
        ) from error
    except Exception as error:
        raise StagingError(
            f"could not download shard {uri} after {retries + 1} attempt(s): {type(error).__name__}: "
            f"{error}; check that the storage endpoint is reachable"
        ) from error


def stage_files(manifest: Manifest, files: Iterable[str], *, cache_dir: str | None = None,
                storage_options: dict[str, Any] | None = None, retries: int = retry.DEFAULT_RETRIES) -> StageReport:
    """Copy the given shards of a dataset to the local cache, verified against the manifest's shard digests.

    Each file is streamed in chunks (never held in memory) to a temporary file and renamed into place only
    once its checksum matches, so the cache never holds a partial or wrong shard under its real name. A file
    already cached is reused when its size and digest match. Transient storage errors are retried with
    exponential backoff (`core.retry`); a checksum mismatch is reported at once.

    Args:
        manifest: the dataset manifest (remote `dataset_uri`).
        files: manifest-relative shard paths to stage.
        cache_dir: the cache root; default `default_cache_dir()`.
        storage_options: fsspec options for the dataset's URI (the config's top-level `storage_options`).
        retries: retries per file after the first attempt.

    Returns:
        The StageReport (local directory, downloaded and reused files).

    Raises:
        StagingError: a file is not in the manifest, missing, refused or not matching it, or the storage still
            fails after the retries.
    """
    known = {s.path: s for s in manifest.shards}
    wanted = list(dict.fromkeys(files))
    unknown = [f for f in wanted if f not in known]
    if unknown:
        raise StagingError(f"files {unknown} are not shards of the manifest of {manifest.dataset_uri}; pass paths "
                           "relative to the dataset directory as listed in manifest.json")
    local_dir = dataset_cache_dir(manifest, cache_dir)
    fs, root = storage.get_fs(manifest.dataset_uri, storage_options)
    downloaded, reused, num_bytes = [], [], 0
    started = time.perf_counter()
    for relative in wanted:
        shard = known[relative]
        local_path = os.path.join(local_dir, *relative.split("/"))
        os.makedirs(os.path.dirname(local_path), exist_ok=True)
        uri = storage.join(manifest.dataset_uri, relative)
        with _file_lock(local_path):
            if _is_verified(local_path, shard, manifest.shard_digest):
                reused.append(relative)
                continue
            remote_path = f"{root.rstrip('/')}/{relative}"
            num_bytes += _fetch_shard(fs, remote_path, local_path, shard, manifest.shard_digest, uri, retries)
            downloaded.append(relative)
    _stage_statistics(manifest, fs, root, local_dir)
    elapsed = time.perf_counter() - started
    logger.info("staged %d shard(s) of %s to %s: %d downloaded (%.1f MB in %.1fs), %d reused from the cache",
                len(wanted), manifest.dataset_uri, local_dir, len(downloaded), num_bytes / 1e6, elapsed, len(reused))
    return StageReport(local_dir=local_dir, downloaded=tuple(downloaded), reused=tuple(reused),
                       num_bytes_downloaded=num_bytes)


def _stage_statistics(manifest: Manifest, fs, root: str, local_dir: str) -> None:
    """statistics.json beside the staged shards: the model's preprocessing is built from it on every worker."""
    if not manifest.statistics_sha256:
        return
    local_path = os.path.join(local_dir, STATISTICS_NAME)
    sha256 = digests.DigestAlgorithm.SHA256
    if os.path.exists(local_path) and digests.local_file_digest(local_path, sha256) == manifest.statistics_sha256:
        return
    os.makedirs(local_dir, exist_ok=True)
    partial = f"{local_path}.{os.getpid()}.part"  # workers on one machine share the cache: replace atomically
    fs.get_file(f"{root.rstrip('/')}/{STATISTICS_NAME}", partial)
    os.replace(partial, local_path)


def stage_split(manifest: Manifest, split: str, *, cache_dir: str | None = None,
                storage_options: dict[str, Any] | None = None) -> Manifest:
    """Stage every shard of one split (evaluation reads the whole eval split) and return the local manifest.

    A local dataset is returned unchanged.
    """
    if not needs_staging(manifest):
        return manifest
    report = stage_files(manifest, [s.path for s in manifest.shards_for(split)], cache_dir=cache_dir,
                         storage_options=storage_options)
    return localize_manifest(manifest, report.local_dir)


def stage_for_worker(manifest: Manifest, plan: ShardPlan | None, cluster: ClusterInfo, *,
                     cache_dir: str | None = None, storage_options: dict[str, Any] | None = None,
                     include_eval: bool | None = None) -> Manifest:
    """Stage the shards this worker reads and return a manifest tf.data can read locally.

    The returned manifest lists every shard (its content hash stays the one every worker agrees on) but
    only this worker's files exist under its local `dataset_uri`: FILE policy, its own train files; DATA
    policy, every train file; the chief also gets the eval split. A local dataset is returned unchanged.

    Args:
        manifest: the dataset manifest.
        plan: the shard plan (None: every train file, e.g. a parameter-server coordinator).
        cluster: this process's cluster value.
        cache_dir: the cache root; default `default_cache_dir()`.
        storage_options: fsspec options for the dataset's URI.
        include_eval: stage the eval split too; default: on the chief.

    Returns:
        The manifest with a local `dataset_uri`.
    """
    if not needs_staging(manifest):
        logger.info("dataset %s is local: no staging", manifest.dataset_uri)
        return manifest
    include_eval = cluster.is_chief if include_eval is None else include_eval
    worker_index = max(cluster.worker_index, 0)
    files = files_for_worker(manifest, plan, worker_index, include_eval=include_eval)
    report = stage_files(manifest, files, cache_dir=cache_dir, storage_options=storage_options)
    return localize_manifest(manifest, report.local_dir)
