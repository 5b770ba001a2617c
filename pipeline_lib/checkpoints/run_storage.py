"""Where one task of a run writes, and how a remote `run_dir` gets its checkpoints and logs (local, then remote).

TensorFlow writes checkpoints and summaries to a local directory; the chief then publishes them to a remote
`run_dir` through fsspec (`publish`). A restore downloads the newest remote checkpoint that verifies, falling
back to older ones. TensorBoard event files are re-uploaded whenever they grew, so TensorBoard can be pointed
at the remote directory while training goes on.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from typing import Any

from pipeline_lib.checkpoints import layout, manifests
from pipeline_lib.checkpoints.publish import CheckpointPublisher, PublishError
from pipeline_lib.checkpoints.records import CheckpointRecord
from pipeline_lib.checkpoints.tree_sync import TreeSync
from pipeline_lib.cluster.info import ClusterInfo
from pipeline_lib.config import Direction
from pipeline_lib.core import storage
from pipeline_lib.core.paths import default_cache_dir

RUNS_DIR = "runs"


def is_remote(uri: str) -> bool:
    """True for a URI TensorFlow cannot write itself (anything but a local path or file://)."""
    return not storage.is_local(uri)


def local_mirror_dir(run_dir: str, cluster: ClusterInfo | None = None, cache_dir: str | None = None) -> str:
    """Where one task lets TensorFlow write a run: `run_dir` itself when local, else a private local mirror.

    The mirror is `<cache>/runs/<sha256(run_dir)[:16]>/<task>`: one per task, so workers sharing a host
    never write into each other's files.
    """
    if not is_remote(run_dir):
        return storage.local_path(run_dir)
    cluster = cluster or ClusterInfo()
    digest = hashlib.sha256(run_dir.encode()).hexdigest()[:16]
    return os.path.join(cache_dir or default_cache_dir(), RUNS_DIR, digest,
                        f"{cluster.task_type}-{cluster.task_index}")


def _split_prefix(prefix_uri: str) -> tuple[str, int]:
    directory, name = prefix_uri.rstrip("/").rsplit("/", 1)
    step = layout.step_of_prefix(name)
    if step is None:
        raise PublishError(f"{prefix_uri!r} is not a checkpoint prefix (<dir>/{layout.PREFIX_NAME}-<step>)")
    return directory, step


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
                           best_direction: Direction = Direction.MAX) -> CheckpointRecord | None:
        """Chief, remote run: upload a just-saved local checkpoint, then apply retention remotely."""
        if self.publisher is None or record is None or not self.cluster.is_chief:
            return None
        published = self.publisher.publish(record.path)
        self.publisher.apply_retention(keep, best_metric, best_direction)
        self.sync_tensorboard()
        return published

    def sync_tensorboard(self) -> int:
        """Chief, remote run: upload the TensorBoard files written since the last sync."""
        return self.tensorboard_sync.sync() if self.tensorboard_sync is not None else 0

    def checkpoint_records(self) -> tuple[CheckpointRecord, ...]:
        """The run's committed checkpoints where the run lives: remote URIs for a remote run."""
        if self.publisher is not None:
            return tuple(self.publisher.list_checkpoints())
        return tuple(manifests.list_checkpoints(self.local_checkpoint_dir))
