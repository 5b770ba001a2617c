"""Checkpoints with integrity manifests: save, verify, newest-valid restore and keep-N-plus-best retention."""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import re
from collections.abc import Callable

import tensorflow as tf

from pipeline_lib.cluster.validation import ClusterInfo, worker_scratch_dir
from pipeline_lib.config import Direction, PipelineConfig, Task
from pipeline_lib.core.errors import TfdagError
from pipeline_lib.training.loop import CheckpointRecord

logger = logging.getLogger(__name__)

PREFIX_NAME = "ckpt"
MANIFEST_SUFFIX = ".manifest.json"
_PREFIX_RE = re.compile(rf"^{PREFIX_NAME}-(\d+)$")
_CHUNK = 4 * 1024 * 1024


class CheckpointError(TfdagError, RuntimeError):
    """A checkpoint cannot be verified or restored; the message names the checkpoint and the fix."""


def selection_metric(config: PipelineConfig) -> tuple[str, Direction]:
    """The checkpoint-manifest metric that `evaluation.select: best` ranks by, and its direction.

    `evaluation.gate.metric` maps to the metric the training loop records (`accuracy` → `eval_accuracy`);
    loss and mae are always minimised; regression falls back to `eval_mae` for classification-only metrics.
    """
    gate = config.evaluation.gate
    if gate.metric in ("loss", "mae"):
        return f"eval_{gate.metric}", Direction.MIN
    if config.model.task == Task.REGRESSION:
        return "eval_mae", Direction.MIN
    if gate.metric == "accuracy":
        return "eval_accuracy", gate.direction
    # The loop records no AUC per checkpoint; rank by the loss instead.
    return "eval_loss", Direction.MIN


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with tf.io.gfile.GFile(path, "rb") as handle:
        while True:
            chunk = handle.read(_CHUNK)
            if not chunk:
                break
            digest.update(chunk)
    return digest.hexdigest()


def prefix_for(checkpoint_dir: str, step: int) -> str:
    """The checkpoint prefix of a step: `<dir>/ckpt-<step>`."""
    return os.path.join(checkpoint_dir, f"{PREFIX_NAME}-{step}")


def manifest_path(prefix: str) -> str:
    return prefix + MANIFEST_SUFFIX


def _files_of(prefix: str) -> list[str]:
    """The data and index files TensorFlow wrote for a prefix (not its manifest)."""
    return sorted(p for p in tf.io.gfile.glob(prefix + ".*") if not p.endswith(MANIFEST_SUFFIX)
                  and ".tmp" not in os.path.basename(p))


def _prefixes(checkpoint_dir: str) -> dict[int, str]:
    """Every checkpoint prefix in a directory (with or without a manifest), by step."""
    found: dict[int, str] = {}
    if not tf.io.gfile.isdir(checkpoint_dir):
        return found
    for name in tf.io.gfile.listdir(checkpoint_dir):
        base = name.rstrip("/").split(".", 1)[0]
        match = _PREFIX_RE.match(base)
        if match:
            found[int(match.group(1))] = os.path.join(checkpoint_dir, base)
    return found


def read_manifest(prefix: str) -> dict | None:
    """The manifest of a checkpoint prefix, or None when it is missing or unreadable."""
    path = manifest_path(prefix)
    if not tf.io.gfile.exists(path):
        return None
    try:
        with tf.io.gfile.GFile(path, "r") as handle:
            return json.loads(handle.read())
    except (ValueError, tf.errors.OpError):
        return None


def verify(prefix: str) -> str | None:
    """Check a checkpoint against its manifest.

    Returns:
        None when every file is present with the recorded sha256, else what is wrong, in words.
    """
    manifest = read_manifest(prefix)
    if manifest is None:
        return f"{os.path.basename(prefix)} has no readable manifest (an interrupted save?)"
    directory = os.path.dirname(prefix)
    for entry in manifest.get("files", []):
        path = os.path.join(directory, entry["name"])
        if not tf.io.gfile.exists(path):
            return f"{entry['name']} is missing"
        digest = _sha256(path)
        if digest != entry["sha256"]:
            return f"{entry['name']} has sha256 {digest[:12]}…, the manifest records {entry['sha256'][:12]}…"
    return None


def _record(prefix: str, manifest: dict) -> CheckpointRecord:
    return CheckpointRecord(step=int(manifest["step"]), path=prefix,
                            metrics={k: float(v) for k, v in manifest.get("metrics", {}).items()})


def list_checkpoints(checkpoint_dir: str) -> list[CheckpointRecord]:
    """Every committed checkpoint (one with a manifest) in a directory, oldest first; files are not re-hashed."""
    records = []
    for step, prefix in sorted(_prefixes(checkpoint_dir).items()):
        manifest = read_manifest(prefix)
        if manifest is not None:
            records.append(_record(prefix, manifest))
    return records


def latest_valid(checkpoint_dir: str) -> CheckpointRecord | None:
    """The newest checkpoint whose manifest verifies; older ones are tried, with a warning, when it does not."""
    for step, prefix in sorted(_prefixes(checkpoint_dir).items(), reverse=True):
        problem = verify(prefix)
        if problem is None:
            return _record(prefix, read_manifest(prefix))
        logger.warning("checkpoint %s is not valid: %s; falling back to the previous one", prefix, problem)
    return None


class CheckpointStore:
    """Saves and restores one `tf.train.Checkpoint(model=..., optimizer=..., step=...)`.

    Only the chief keeps what it saves; other workers take part in every save (their variables may need
    collectives) but write to a scratch directory that is removed right after.
    """

    def __init__(self, checkpoint_dir: str, checkpoint: tf.train.Checkpoint, *, cluster: ClusterInfo | None = None,
                 keep: int = 3, best_metric: str | None = None, best_mode: str = "max"):
        if keep < 1:
            raise ValueError(f"keep ({keep}) must be ≥ 1: train.keep_checkpoints")
        self.checkpoint_dir = checkpoint_dir
        self.checkpoint = checkpoint
        self.cluster = cluster or ClusterInfo()
        self.keep = keep
        self.best_metric = best_metric
        self.best_mode = best_mode

    @property
    def is_writer(self) -> bool:
        return self.cluster.is_chief

    def save(self, step: int, metrics_fn: Callable[[], dict[str, float]] | None = None) -> CheckpointRecord | None:
        """Write the checkpoint of `step`, then (chief) its manifest last, then apply retention.

        Args:
            step: the global step the checkpoint holds.
            metrics_fn: called on the chief after the files are written; its metrics go in the manifest.

        Returns:
            The chief's CheckpointRecord; None on other workers.
        """
        target_dir = worker_scratch_dir(self.checkpoint_dir, self.cluster)
        tf.io.gfile.makedirs(target_dir)
        prefix = prefix_for(target_dir, step)
        if not self.is_writer:
            try:
                self.checkpoint.write(prefix)
            finally:
                tf.io.gfile.rmtree(target_dir)
            return None
        self.checkpoint.write(prefix)
        metrics = dict(metrics_fn()) if metrics_fn is not None else {}
        files = [{"name": os.path.basename(p), "size": tf.io.gfile.stat(p).length, "sha256": _sha256(p)}
                 for p in _files_of(prefix)]
        manifest = {
            "step": int(step),
            "prefix": os.path.basename(prefix),
            "files": files,
            "metrics": {k: float(v) for k, v in metrics.items()},
            "created_at": datetime.datetime.now(datetime.UTC).isoformat(),
        }
        # The manifest goes last: its presence is what makes the checkpoint count.
        tmp = manifest_path(prefix) + ".tmp"
        with tf.io.gfile.GFile(tmp, "w") as handle:
            handle.write(json.dumps(manifest, indent=2, sort_keys=True))
        tf.io.gfile.rename(tmp, manifest_path(prefix), overwrite=True)
        record = _record(prefix, manifest)
        kept = self._apply_retention()
        self._write_state_file(prefix, kept)
        logger.info("checkpoint %s saved (%d files, metrics %s)", prefix, len(files), manifest["metrics"])
        return record

    def best(self, records: list[CheckpointRecord] | None = None) -> CheckpointRecord | None:
        """The checkpoint with the best `best_metric` (None when no checkpoint has it)."""
        records = list_checkpoints(self.checkpoint_dir) if records is None else records
        scored = [r for r in records if self.best_metric and self.best_metric in r.metrics]
        if not scored:
            return None
        pick = max if self.best_mode == "max" else min
        # Ties go to the newest checkpoint.
        return pick(reversed(scored), key=lambda r: r.metrics[self.best_metric])

    def _apply_retention(self) -> list[CheckpointRecord]:
        records = list_checkpoints(self.checkpoint_dir)
        keep = {r.step for r in records[-self.keep:]}
        best = self.best(records)
        if best is not None:
            keep.add(best.step)
        newest = records[-1].step if records else -1
        for step, prefix in _prefixes(self.checkpoint_dir).items():
            committed = read_manifest(prefix) is not None
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
        for path in [manifest_path(prefix), *_files_of(prefix)]:
            if tf.io.gfile.exists(path):
                tf.io.gfile.remove(path)
        logger.info("checkpoint %s removed by retention", prefix)

    def latest_valid(self) -> CheckpointRecord | None:
        """The newest verified checkpoint of this store's directory."""
        return latest_valid(self.checkpoint_dir)

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
