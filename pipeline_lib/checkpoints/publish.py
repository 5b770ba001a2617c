"""Local-then-remote publishing of a run: checkpoints (manifest uploaded last), TensorBoard logs, restores.

TensorFlow writes checkpoints and summaries to a local directory; the chief then publishes them to a remote
`run_dir` through fsspec. Object stores have no atomic rename, so a checkpoint's files go up first and its
manifest last: a checkpoint without its manifest is debris of an interrupted upload and never counts.
A restore downloads the newest remote checkpoint whose files match their manifest's sha256, falling back
to older ones. TensorBoard event files are re-uploaded whenever they grew, so TensorBoard can be pointed at
the remote directory while training goes on.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import posixpath
import re
import shutil
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

from pipeline_lib.checkpoints import store as ckpt
from pipeline_lib.cluster.validation import ClusterInfo
from pipeline_lib.core import storage
from pipeline_lib.training.loop import CheckpointRecord

logger = logging.getLogger(__name__)

RUNS_DIR = "runs"
DEFAULT_RETRIES = 3
RETRY_BACKOFF_S = 1.0


T = TypeVar("T")


class PublishError(storage.StorageError):
    """A run's files cannot be published or restored; the message names the URI and the fix."""


def is_remote(uri: str) -> bool:
    """True for a URI TensorFlow cannot write itself (anything but a local path or file://)."""
    return not storage.is_local(uri)


def _retry(fn: Callable[[], T], what: str, retries: int = DEFAULT_RETRIES) -> T:
    """Call fn, retrying transient storage errors with exponential backoff; missing or refused is permanent."""
    attempt = 0
    while True:
        try:
            return fn()
        except (FileNotFoundError, PermissionError, PublishError):
            raise
        except Exception as error:
            if attempt >= retries:
                raise PublishError(f"{what} failed after {attempt + 1} attempt(s): {type(error).__name__}: {error}; "
                                   "check that the storage endpoint is reachable") from error
            attempt += 1
            delay = RETRY_BACKOFF_S * 2 ** (attempt - 1)
            logger.warning("%s failed (%s: %s); retry %d of %d in %.1fs", what, type(error).__name__, error,
                           attempt, retries, delay)
            time.sleep(delay)


def local_mirror_dir(run_dir: str, cluster: ClusterInfo | None = None, cache_dir: str | None = None) -> str:
    """Where one task lets TensorFlow write a run: `run_dir` itself when local, else a private local mirror.

    The mirror is `<cache>/runs/<sha256(run_dir)[:16]>/<task>`: one per task, so workers sharing a host
    never write into each other's files.
    """
    if not is_remote(run_dir):
        return storage.local_path(run_dir)
    from pipeline_lib.training.staging import default_cache_dir

    cluster = cluster or ClusterInfo()
    digest = hashlib.sha256(run_dir.encode()).hexdigest()[:16]
    return os.path.join(cache_dir or default_cache_dir(), RUNS_DIR, digest,
                        f"{cluster.task_type}-{cluster.task_index}")


@functools.cache
def _patterns() -> tuple[re.Pattern, re.Pattern]:
    """(manifest name, any checkpoint file name) patterns; built lazily: checkpoints may still be importing."""
    return (re.compile(rf"^{ckpt.PREFIX_NAME}-(\d+){re.escape(ckpt.MANIFEST_SUFFIX)}$"),
            re.compile(rf"^{ckpt.PREFIX_NAME}-(\d+)\."))


def _step_of_file(name: str) -> int | None:
    match = _patterns()[1].match(name)
    return int(match.group(1)) if match else None


def _record_from(prefix: str, manifest: dict) -> CheckpointRecord:
    return CheckpointRecord(step=int(manifest["step"]), path=prefix,
                            metrics={k: float(v) for k, v in manifest.get("metrics", {}).items()})


class CheckpointPublisher:
    """Publishes local checkpoints to one remote checkpoint directory and restores them from it.

    Remote layout mirrors TensorFlow's: `<remote_dir>/ckpt-<step>.index`, `.data-*`, and
    `ckpt-<step>.manifest.json`, which is uploaded last and deleted first.
    """

    def __init__(self, remote_dir: str, storage_options: dict[str, Any] | None = None, *,
                 retries: int = DEFAULT_RETRIES):
        self.remote_dir = remote_dir.rstrip("/")
        self.fs, self.root = storage.get_fs(self.remote_dir, storage_options)
        self.root = self.root.rstrip("/")
        self.retries = retries

    def _path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def uri_of(self, name: str) -> str:
        """The full URI of a file in the remote checkpoint directory."""
        return f"{self.remote_dir}/{name}"

    def _manifest_name(self, step: int) -> str:
        return f"{ckpt.PREFIX_NAME}-{step}{ckpt.MANIFEST_SUFFIX}"

    def _read_manifest(self, step: int) -> dict | None:
        path = self._path(self._manifest_name(step))
        try:
            return json.loads(self.fs.cat_file(path))
        except FileNotFoundError:
            return None
        except ValueError:
            logger.warning("remote checkpoint manifest %s is not valid JSON; ignoring it",
                           self.uri_of(self._manifest_name(step)))
            return None

    def _names(self) -> list[str]:
        self.fs.invalidate_cache(self.root)
        try:
            return sorted(posixpath.basename(p.rstrip("/")) for p in self.fs.ls(self.root, detail=False))
        except FileNotFoundError:
            return []

    def publish(self, prefix: str) -> CheckpointRecord:
        """Upload one committed local checkpoint: its files, then its manifest last.

        Args:
            prefix: the local checkpoint prefix (`<dir>/ckpt-<step>`), whose manifest lists its files.

        Returns:
            The CheckpointRecord of the remote checkpoint (its path a URI prefix).

        Raises:
            PublishError: when the local checkpoint has no manifest, or the upload keeps failing.
        """
        manifest = ckpt.read_manifest(prefix)
        if manifest is None:
            raise PublishError(f"checkpoint {prefix} has no manifest; only a committed checkpoint (its manifest "
                               "written last by CheckpointStore.save) can be published")
        step = int(manifest["step"])
        local_dir = os.path.dirname(prefix)
        manifest_name = self._manifest_name(step)
        started = time.perf_counter()

        def drop_old_manifest() -> None:
            # A re-published step must not look complete while its files are being replaced.
            if self.fs.exists(self._path(manifest_name)):
                self.fs.rm_file(self._path(manifest_name))

        _retry(drop_old_manifest, f"removing the old manifest {self.uri_of(manifest_name)}", self.retries)
        self.fs.makedirs(self.root, exist_ok=True)
        num_bytes = 0
        for entry in manifest["files"]:
            name = entry["name"]
            source = os.path.join(local_dir, name)
            _retry(lambda source=source, name=name: self.fs.put_file(source, self._path(name)),
                   f"uploading {self.uri_of(name)}", self.retries)
            num_bytes += int(entry["size"])
        payload = json.dumps(manifest, indent=2, sort_keys=True).encode()
        # Last: one PUT of one object, atomic on every object store; from now on the checkpoint counts.
        _retry(lambda: self.fs.pipe_file(self._path(manifest_name), payload),
               f"uploading {self.uri_of(manifest_name)}", self.retries)
        logger.info("published checkpoint step %d to %s (%d files, %.1f MB, %.1fs)", step, self.remote_dir,
                    len(manifest["files"]), num_bytes / 1e6, time.perf_counter() - started)
        return _record_from(self.uri_of(f"{ckpt.PREFIX_NAME}-{step}"), manifest)

    def steps(self) -> dict[int, bool]:
        """Every remote checkpoint step found, with whether its manifest is there (committed)."""
        found: dict[int, bool] = {}
        manifest_re = _patterns()[0]
        for name in self._names():
            match = manifest_re.match(name)
            if match:
                found[int(match.group(1))] = True
                continue
            step = _step_of_file(name)
            if step is not None:
                found.setdefault(step, False)
        return found

    def list_checkpoints(self) -> list[CheckpointRecord]:
        """Every committed remote checkpoint (manifest present), oldest first; files are not re-hashed."""
        records = []
        for step, committed in sorted(self.steps().items()):
            manifest = self._read_manifest(step) if committed else None
            if manifest is not None:
                records.append(_record_from(self.uri_of(f"{ckpt.PREFIX_NAME}-{step}"), manifest))
        return records

    def _delete(self, step: int) -> None:
        names = [n for n in self._names() if _step_of_file(n) == step]
        manifest_name = self._manifest_name(step)
        # Manifest first, so a half-deleted checkpoint never looks complete.
        for name in sorted(names, key=lambda n: n != manifest_name):
            _retry(lambda name=name: self.fs.rm_file(self._path(name)), f"removing {self.uri_of(name)}",
                   self.retries)
        logger.info("remote checkpoint step %d removed from %s by retention", step, self.remote_dir)

    def apply_retention(self, keep: int, best_metric: str | None = None,
                        best_mode: str = "max") -> list[CheckpointRecord]:
        """Keep the newest `keep` remote checkpoints plus the best by `best_metric`; remove the rest.

        Uncommitted files older than the newest committed checkpoint (an interrupted upload) are removed too.

        Returns:
            The checkpoints kept, oldest first.
        """
        records = self.list_checkpoints()
        kept = {r.step for r in records[-keep:]}
        scored = [r for r in records if best_metric and best_metric in r.metrics]
        if scored:
            pick = max if best_mode == "max" else min
            kept.add(pick(reversed(scored), key=lambda r: r.metrics[best_metric]).step)
        newest = records[-1].step if records else -1
        for step, committed in self.steps().items():
            if step in kept or (not committed and step > newest):
                continue
            self._delete(step)
        return [r for r in records if r.step in kept]

    def fetch(self, step: int, local_dir: str) -> CheckpointRecord:
        """Download one remote checkpoint into `local_dir` and verify it; the local manifest is written last.

        Files already present locally with the manifest's sha256 are not downloaded again.

        Returns:
            The CheckpointRecord with the local prefix.

        Raises:
            PublishError: when the checkpoint has no manifest, a file is missing, or a sha256 differs.
        """
        manifest = _retry(lambda: self._read_manifest(step), f"reading {self.uri_of(self._manifest_name(step))}",
                          self.retries)
        if manifest is None:
            raise PublishError(f"remote checkpoint {self.uri_of(f'{ckpt.PREFIX_NAME}-{step}')} has no manifest "
                               f"({self._manifest_name(step)}): its upload never finished; use an older checkpoint")
        os.makedirs(local_dir, exist_ok=True)
        prefix = ckpt.prefix_for(local_dir, step)
        local_manifest = ckpt.manifest_path(prefix)
        if os.path.exists(local_manifest):
            os.remove(local_manifest)
        for entry in manifest["files"]:
            name = entry["name"]
            target = os.path.join(local_dir, name)
            if os.path.exists(target) and storage.sha256_local(target) == entry["sha256"]:
                continue
            tmp = f"{target}.tmp-{uuid.uuid4().hex[:8]}"
            try:
                _retry(lambda name=name, tmp=tmp: self.fs.get_file(self._path(name), tmp),
                       f"downloading {self.uri_of(name)}", self.retries)
            except FileNotFoundError as error:
                raise PublishError(f"{self.uri_of(name)} listed in the manifest of remote checkpoint step {step} "
                                   "is missing; the checkpoint is damaged: use an older one") from error
            digest = storage.sha256_local(tmp)
            if digest != entry["sha256"]:
                os.remove(tmp)
                raise PublishError(f"{self.uri_of(name)} has sha256 {digest[:12]}…, its manifest records "
                                   f"{entry['sha256'][:12]}…; the remote checkpoint step {step} is damaged")
            os.replace(tmp, target)
        with open(local_manifest + ".tmp", "w") as handle:
            handle.write(json.dumps(manifest, indent=2, sort_keys=True))
        os.replace(local_manifest + ".tmp", local_manifest)
        return _record_from(prefix, manifest)

    def restore_latest(self, local_dir: str) -> CheckpointRecord | None:
        """Download the newest remote checkpoint that verifies into `local_dir`; older ones on failure.

        Returns:
            The local CheckpointRecord, or None when the remote directory holds no committed checkpoint.
        """
        for record in reversed(self.list_checkpoints()):
            try:
                local = self.fetch(record.step, local_dir)
            except PublishError as error:
                logger.warning("remote checkpoint %s is not usable: %s; falling back to the previous one",
                               record.path, error)
                continue
            logger.info("downloaded remote checkpoint %s (step %d) to %s", record.path, record.step, local_dir)
            return local
        return None


def _split_prefix(prefix_uri: str) -> tuple[str, int]:
    directory, name = prefix_uri.rstrip("/").rsplit("/", 1)
    match = re.match(rf"^{ckpt.PREFIX_NAME}-(\d+)$", name)
    if not match:
        raise PublishError(f"{prefix_uri!r} is not a checkpoint prefix (<dir>/{ckpt.PREFIX_NAME}-<step>)")
    return directory, int(match.group(1))


def localize_checkpoint(record: CheckpointRecord, storage_options: dict[str, Any] | None = None, *,
                        cache_dir: str | None = None) -> CheckpointRecord:
    """A record whose checkpoint TensorFlow can read: itself when local, else a verified download.

    Remote checkpoints go to `<cache>/runs/<sha256(dir)[:16]>/fetched/`; consolidation and evaluation of a
    remote run call this before `tf.train.Checkpoint.read`.
    """
    if not is_remote(record.path):
        return record
    directory, step = _split_prefix(record.path)
    local_dir = os.path.join(local_mirror_dir(directory, cache_dir=cache_dir), "fetched")
    return CheckpointPublisher(directory, storage_options).fetch(step, local_dir)


class TreeSync:
    """Mirrors a local directory to a remote one, uploading only files that changed since the last sync.

    Object stores cannot append, so a grown event file is uploaded whole; TensorBoard logs are small.
    """

    def __init__(self, local_dir: str, remote_uri: str, storage_options: dict[str, Any] | None = None):
        self.local_dir = local_dir
        self.remote_uri = remote_uri.rstrip("/")
        self.fs, root = storage.get_fs(self.remote_uri, storage_options)
        self.root = root.rstrip("/")
        self._synced: dict[str, tuple[int, int]] = {}

    def sync(self) -> int:
        """Upload new and changed files; a failure is logged and retried at the next sync.

        Returns:
            The number of files uploaded.
        """
        if not os.path.isdir(self.local_dir):
            return 0
        uploaded = 0
        for relative in storage.iter_files(self.local_dir):
            source = os.path.join(self.local_dir, relative)
            try:
                stat = os.stat(source)
            except FileNotFoundError:
                continue
            version = (stat.st_size, stat.st_mtime_ns)
            if self._synced.get(relative) == version:
                continue
            target = f"{self.root}/{relative.replace(os.sep, '/')}"
            try:
                self.fs.makedirs(posixpath.dirname(target), exist_ok=True)
                self.fs.put_file(source, target)
            except Exception as error:  # noqa: BLE001 - logs are best effort; the next sync catches up
                logger.warning("could not sync %s to %s (%s: %s); retrying at the next sync", relative,
                               self.remote_uri, type(error).__name__, error)
                continue
            self._synced[relative] = version
            uploaded += 1
        if uploaded:
            logger.debug("synced %d file(s) of %s to %s", uploaded, self.local_dir, self.remote_uri)
        return uploaded


class RunStorage:
    """Where one task of a run lets TensorFlow write, and how the chief publishes a remote `run_dir`.

    With a local `run_dir` everything is written in place and the publishing methods do nothing. With a
    remote one, each task writes to its own local mirror; the chief publishes every checkpoint (manifest
    last, then remote retention) and syncs TensorBoard logs; every task restores from the remote copy, so
    all workers start from the same step.
    """

    def __init__(self, run_dir: str, cluster: ClusterInfo | None = None, storage_options: dict[str, Any] | None = None,
                 *, checkpoint_subdir: str = "checkpoints", tensorboard_subdir: str = "tensorboard",
                 cache_dir: str | None = None):
        self.run_dir = run_dir
        self.cluster = cluster or ClusterInfo()
        self.is_remote = is_remote(run_dir)
        self.local_dir = local_mirror_dir(run_dir, self.cluster, cache_dir) if self.is_remote else run_dir
        self.local_checkpoint_dir = os.path.join(self.local_dir, checkpoint_subdir)
        self.local_tensorboard_dir = os.path.join(self.local_dir, tensorboard_subdir)
        self.checkpoint_dir = storage.join(run_dir, checkpoint_subdir) if self.is_remote else self.local_checkpoint_dir
        self.tensorboard_dir = (storage.join(run_dir, tensorboard_subdir) if self.is_remote
                                else self.local_tensorboard_dir)
        self.publisher = CheckpointPublisher(self.checkpoint_dir, storage_options) if self.is_remote else None
        self.tensorboard_sync = (TreeSync(self.local_tensorboard_dir, self.tensorboard_dir, storage_options)
                                 if self.is_remote and self.cluster.is_chief else None)

    def prepare_restore(self) -> CheckpointRecord | None:
        """Remote run: replace the local checkpoints by the newest verified remote one (None: fresh start).

        Local leftovers are dropped because a checkpoint the chief saved but never published would make it
        resume at a step the other workers do not have.
        """
        if self.publisher is None:
            return None
        if os.path.isdir(self.local_checkpoint_dir):
            shutil.rmtree(self.local_checkpoint_dir)
        return self.publisher.restore_latest(self.local_checkpoint_dir)

    def publish_checkpoint(self, record: CheckpointRecord | None, *, keep: int, best_metric: str | None = None,
                           best_mode: str = "max") -> CheckpointRecord | None:
        """Chief, remote run: upload a just-saved local checkpoint, then apply retention remotely."""
        if self.publisher is None or record is None or not self.cluster.is_chief:
            return None
        published = self.publisher.publish(record.path)
        self.publisher.apply_retention(keep, best_metric, best_mode)
        self.sync_tensorboard()
        return published

    def sync_tensorboard(self) -> int:
        """Chief, remote run: upload the TensorBoard files written since the last sync."""
        return self.tensorboard_sync.sync() if self.tensorboard_sync is not None else 0

    def checkpoint_records(self) -> tuple[CheckpointRecord, ...]:
        """The run's committed checkpoints where the run lives: remote URIs for a remote run."""
        if self.publisher is not None:
            return tuple(self.publisher.list_checkpoints())
        return tuple(ckpt.list_checkpoints(self.local_checkpoint_dir))
