"""The checkpoint store: save with an integrity manifest written last, restore the newest valid, apply retention."""

from __future__ import annotations

import datetime
import json
import logging
import os
from collections.abc import Callable

import tensorflow as tf

from pipeline_lib.checkpoints import layout, manifests, selection
from pipeline_lib.checkpoints.records import (
    DATA_POSITION_KEY,
    CheckpointRecord,
    DataPosition,
)
from pipeline_lib.cluster.info import ClusterInfo, worker_scratch_dir
from pipeline_lib.config import Direction
from pipeline_lib.core.errors import TfdagError

logger = logging.getLogger(__name__)


class CheckpointError(TfdagError, RuntimeError):
    """A checkpoint cannot be verified or restored; the message names the checkpoint and the fix."""


class CheckpointStore:
    """Saves and restores one `tf.train.Checkpoint(model=..., optimizer=..., step=...)`.

    Only the chief keeps what it saves; other workers take part in every save (their variables may need
    collectives) but write to a scratch directory that is removed right after.
    """

    def __init__(self, checkpoint_dir: str, checkpoint: tf.train.Checkpoint, *, cluster: ClusterInfo | None = None,
                 keep: int = 3, best_metric: str | None = None, best_direction: Direction = Direction.MAX):
        if keep < 1:
            raise ValueError(f"keep ({keep}) must be ≥ 1: train.keep_checkpoints")
        self.checkpoint_dir = checkpoint_dir
        self.checkpoint = checkpoint
        self.cluster = cluster or ClusterInfo()
        self.keep = keep
        self.best_metric = best_metric
        self.best_direction = best_direction

    @property
    def is_writer(self) -> bool:
        return self.cluster.is_chief

    def save(self, step: int, metrics_fn: Callable[[], dict[str, float]] | None = None,
             data_position: DataPosition | None = None) -> CheckpointRecord | None:
        """Write the checkpoint of `step`, then (chief) its manifest last, then apply retention.

        Args:
            step: the global step the checkpoint holds.
            metrics_fn: called on the chief after the files are written; its metrics go in the manifest.
            data_position: an elastic run's position in its data, kept in the manifest.

        Returns:
            The chief's CheckpointRecord; None on other workers.
        """
        target_dir = worker_scratch_dir(self.checkpoint_dir, self.cluster)
        tf.io.gfile.makedirs(target_dir)
        prefix = layout.prefix_for(target_dir, step)
        if not self.is_writer:
            try:
                self.checkpoint.write(prefix)
            finally:
                tf.io.gfile.rmtree(target_dir)
            return None
        self.checkpoint.write(prefix)
        metrics = dict(metrics_fn()) if metrics_fn is not None else {}
        files = [{"name": os.path.basename(p), "size": tf.io.gfile.stat(p).length, "sha256": manifests.sha256(p)}
                 for p in manifests.files_of(prefix)]
        manifest = {
            "step": int(step),
            "prefix": os.path.basename(prefix),
            "files": files,
            "metrics": {k: float(v) for k, v in metrics.items()},
            "created_at": datetime.datetime.now(datetime.UTC).isoformat(),
        }
        if data_position is not None:
            manifest[DATA_POSITION_KEY] = data_position.model_dump(mode="json")
        # The manifest goes last: its presence is what makes the checkpoint count.
        tmp = layout.manifest_path(prefix) + ".tmp"
        with tf.io.gfile.GFile(tmp, "w") as handle:
            handle.write(json.dumps(manifest, indent=2, sort_keys=True))
        tf.io.gfile.rename(tmp, layout.manifest_path(prefix), overwrite=True)
        record = CheckpointRecord.from_manifest(prefix, manifest)
        kept = self._apply_retention()
        self._write_state_file(prefix, kept)
        logger.info("checkpoint %s saved (%d files, metrics %s)", prefix, len(files), manifest["metrics"])
        return record

    def best(self, records: list[CheckpointRecord] | None = None) -> CheckpointRecord | None:
        """The checkpoint with the best `best_metric` (None when no checkpoint has it)."""
        records = manifests.list_checkpoints(self.checkpoint_dir) if records is None else records
        return selection.best_checkpoint(records, self.best_metric, self.best_direction)

    def _apply_retention(self) -> list[CheckpointRecord]:
        records = manifests.list_checkpoints(self.checkpoint_dir)
        keep = selection.steps_to_keep(records, self.keep, self.best_metric, self.best_direction)
        newest = records[-1].step if records else -1
        for step, prefix in manifests.prefixes(self.checkpoint_dir).items():
            committed = manifests.read_manifest(prefix) is not None
            # An uncommitted prefix older than the newest committed one is debris of an interrupted save.
            if step in keep or (not committed and step > newest):
                continue
            self._delete(prefix)
        return [r for r in records if r.step in keep]

    def _write_state_file(self, latest: str, kept: list[CheckpointRecord]) -> None:
        # TensorFlow's `checkpoint` state file, so tf.train.latest_checkpoint(dir) works for other tools.
        lines = [f'model_checkpoint_path: "{os.path.basename(latest)}"']
        lines += [f'all_model_checkpoint_paths: "{os.path.basename(r.path)}"' for r in kept]
        path = os.path.join(self.checkpoint_dir, "checkpoint")
        with tf.io.gfile.GFile(path + ".tmp", "w") as handle:
            handle.write("\n".join(lines) + "\n")
        tf.io.gfile.rename(path + ".tmp", path, overwrite=True)

    @staticmethod
    def _delete(prefix: str) -> None:
        # Manifest first, so a half-deleted checkpoint never looks valid.
        for path in [layout.manifest_path(prefix), *manifests.files_of(prefix)]:
            if tf.io.gfile.exists(path):
                tf.io.gfile.remove(path)
        logger.debug("checkpoint %s removed by retention", prefix)

    def latest_valid(self) -> CheckpointRecord | None:
        """The newest verified checkpoint of this store's directory."""
        return manifests.latest_valid(self.checkpoint_dir)

    def restore(self, record: CheckpointRecord) -> None:
        """Restore every object of the checkpoint (model, optimizer, step) from a record.

        Raises:
            CheckpointError: when the checkpoint does not match the objects being restored.
        """
        try:
            self.checkpoint.read(record.path).assert_existing_objects_matched()
        except (AssertionError, ValueError, tf.errors.OpError) as error:
            raise CheckpointError(
                f"checkpoint {record.path} does not match this model/optimizer ({error}); use a fresh run_dir "
                "or the model config it was trained with"
            ) from error

    def restore_latest(self) -> CheckpointRecord | None:
        """Restore the newest valid checkpoint, if any, and return its record."""
        record = self.latest_valid()
        if record is not None:
            self.restore(record)
            logger.info("restored checkpoint %s (step %d)", record.path, record.step)
        return record
