"""Publishing checkpoints to a remote directory and fetching them back: files first, manifest last, verified.

Object stores have no atomic rename, so a checkpoint's files go up first and its manifest last: a checkpoint
without its manifest is debris of an interrupted upload and never counts. A fetch downloads each file to a
temporary name and keeps it only when its sha256 matches the manifest.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import time
from collections.abc import Callable
from typing import Any, TypeVar

from pipeline_lib.checkpoints import layout, manifests, selection
from pipeline_lib.checkpoints.records import CheckpointRecord
from pipeline_lib.config import Direction
from pipeline_lib.core import digests, retry, storage
from pipeline_lib.core.digests import DigestAlgorithm
from pipeline_lib.core.download import ChecksumMismatch, download_verified

logger = logging.getLogger(__name__)

T = TypeVar("T")


class PublishError(storage.StorageError):
    """A run's files cannot be published or restored; the message names the URI and the fix."""


def _retry(fn: Callable[[], T], what: str, retries: int = retry.DEFAULT_RETRIES) -> T:
    """Call fn under the storage retry policy (`core.retry`): missing, refused or damaged is permanent.

    Raises:
        PublishError: when the retries are spent (the permanent errors are raised as they are).
    """
    try:
        return retry.STORAGE_RETRY.call(fn, what, retries=retries)
    except Exception as error:
        if retry.is_permanent(error):
            raise
        raise PublishError(f"{what} failed after {retries + 1} attempt(s): {type(error).__name__}: {error}; "
                           "check that the storage endpoint is reachable") from error


class CheckpointPublisher:
    """Publishes local checkpoints to one remote checkpoint directory and restores them from it.

    Remote layout mirrors TensorFlow's: `<remote_dir>/ckpt-<step>.index`, `.data-*`, and
    `ckpt-<step>.manifest.json`, which is uploaded last and deleted first.
    """

    def __init__(self, remote_dir: str, storage_options: dict[str, Any] | None = None, *,
                 retries: int = retry.DEFAULT_RETRIES):
        self.remote_dir = remote_dir.rstrip("/")
        self.fs, self.root = storage.get_fs(self.remote_dir, storage_options)
        self.root = self.root.rstrip("/")
        self.retries = retries

    def _path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def uri_of(self, name: str) -> str:
        """The full URI of a file in the remote checkpoint directory."""
        return f"{self.remote_dir}/{name}"

    def _read_manifest(self, step: int) -> dict | None:
        path = self._path(layout.manifest_name(step))
        try:
            return json.loads(self.fs.cat_file(path))
        except FileNotFoundError:
            return None
        except ValueError:
            logger.warning("remote checkpoint manifest %s is not valid JSON; ignoring it",
                           self.uri_of(layout.manifest_name(step)))
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
        manifest = manifests.read_manifest(prefix)
        if manifest is None:
            raise PublishError(f"checkpoint {prefix} has no manifest; only a committed checkpoint (its manifest "
                               "written last by CheckpointStore.save) can be published")
        step = int(manifest["step"])
        local_dir = os.path.dirname(prefix)
        manifest_name = layout.manifest_name(step)
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
        return CheckpointRecord.from_manifest(self.uri_of(layout.prefix_name(step)), manifest)

    def steps(self) -> dict[int, bool]:
        """Every remote checkpoint step found, with whether its manifest is there (committed)."""
        found: dict[int, bool] = {}
        for name in self._names():
            step = layout.step_of_manifest(name)
            if step is not None:
                found[step] = True
                continue
            step = layout.step_of_file(name)
            if step is not None:
                found.setdefault(step, False)
        return found

    def list_checkpoints(self) -> list[CheckpointRecord]:
        """Every committed remote checkpoint (manifest present), oldest first; files are not re-hashed."""
        records = []
        for step, committed in sorted(self.steps().items()):
            manifest = self._read_manifest(step) if committed else None
            if manifest is not None:
                records.append(CheckpointRecord.from_manifest(self.uri_of(layout.prefix_name(step)), manifest))
        return records

    def _delete(self, step: int) -> None:
        names = [n for n in self._names() if layout.step_of_file(n) == step]
        manifest_name = layout.manifest_name(step)
        # Manifest first, so a half-deleted checkpoint never looks complete.
        for name in sorted(names, key=lambda n: n != manifest_name):
            _retry(lambda name=name: self.fs.rm_file(self._path(name)), f"removing {self.uri_of(name)}",
                   self.retries)
        logger.info("remote checkpoint step %d removed from %s by retention", step, self.remote_dir)

    def apply_retention(self, keep: int, best_metric: str | None = None,
                        best_direction: Direction = Direction.MAX) -> list[CheckpointRecord]:
        """Keep the newest `keep` remote checkpoints plus the best by `best_metric`; remove the rest.

        Uncommitted files older than the newest committed checkpoint (an interrupted upload) are removed too.

        Returns:
            The checkpoints kept, oldest first.
        """
        records = self.list_checkpoints()
        kept = selection.steps_to_keep(records, keep, best_metric, best_direction)
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
        manifest = _retry(lambda: self._read_manifest(step), f"reading {self.uri_of(layout.manifest_name(step))}",
                          self.retries)
        if manifest is None:
            raise PublishError(f"remote checkpoint {self.uri_of(layout.prefix_name(step))} has no manifest "
                               f"({layout.manifest_name(step)}): its upload never finished; use an older checkpoint")
        os.makedirs(local_dir, exist_ok=True)
        prefix = layout.prefix_for(local_dir, step)
        local_manifest = layout.manifest_path(prefix)
        if os.path.exists(local_manifest):
            os.remove(local_manifest)
        for entry in manifest["files"]:
            name = entry["name"]
            target = os.path.join(local_dir, name)
            if os.path.exists(target) and digests.local_file_digest(target, DigestAlgorithm.SHA256) == entry["sha256"]:
                continue
            try:
                _retry(lambda name=name, target=target, digest=entry["sha256"]: download_verified(
                    self.fs, self._path(name), target, digest), f"downloading {self.uri_of(name)}", self.retries)
            except FileNotFoundError as error:
                raise PublishError(f"{self.uri_of(name)} listed in the manifest of remote checkpoint step {step} "
                                   "is missing; the checkpoint is damaged: use an older one") from error
            except ChecksumMismatch as error:
                raise PublishError(f"{self.uri_of(name)} has sha256 {error.digest[:12]}…, its manifest records "
                                   f"{entry['sha256'][:12]}…; the remote checkpoint step {step} is damaged") from error
        with open(local_manifest + ".tmp", "w") as handle:
            handle.write(json.dumps(manifest, indent=2, sort_keys=True))
        os.replace(local_manifest + ".tmp", local_manifest)
        return CheckpointRecord.from_manifest(prefix, manifest)

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
