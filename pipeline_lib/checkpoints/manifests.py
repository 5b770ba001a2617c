"""Checkpoint integrity manifests: read and verify them, list committed checkpoints, find the newest valid one.

A checkpoint counts only once its manifest (written last) exists; it is valid when every file the manifest
lists is present with the recorded sha256.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os

import tensorflow as tf

from pipeline_lib.checkpoints import layout
from pipeline_lib.checkpoints.records import CheckpointRecord

logger = logging.getLogger(__name__)

_CHUNK = 4 * 1024 * 1024


def sha256(path: str) -> str:
    """The sha256 of a file TensorFlow can read (any path tf.io.gfile accepts)."""
    digest = hashlib.sha256()
    with tf.io.gfile.GFile(path, "rb") as handle:
        while True:
            chunk = handle.read(_CHUNK)
            if not chunk:
                break
            digest.update(chunk)
    return digest.hexdigest()


def files_of(prefix: str) -> list[str]:
    """The data and index files TensorFlow wrote for a prefix (not its manifest)."""
    return sorted(p for p in tf.io.gfile.glob(prefix + ".*") if not p.endswith(layout.MANIFEST_SUFFIX)
                  and ".tmp" not in os.path.basename(p))


def prefixes(checkpoint_dir: str) -> dict[int, str]:
    """Every checkpoint prefix in a directory (with or without a manifest), by step."""
    found: dict[int, str] = {}
    if not tf.io.gfile.isdir(checkpoint_dir):
        return found
    for name in tf.io.gfile.listdir(checkpoint_dir):
        base = name.rstrip("/").split(".", 1)[0]
        step = layout.step_of_prefix(base)
        if step is not None:
            found[step] = os.path.join(checkpoint_dir, base)
    return found


def read_manifest(prefix: str) -> dict | None:
    """The manifest of a checkpoint prefix, or None when it is missing or unreadable."""
    path = layout.manifest_path(prefix)
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
        digest = sha256(path)
        if digest != entry["sha256"]:
            return f"{entry['name']} has sha256 {digest[:12]}…, the manifest records {entry['sha256'][:12]}…"
    return None


def list_checkpoints(checkpoint_dir: str) -> list[CheckpointRecord]:
    """Every committed checkpoint (one with a manifest) in a directory, oldest first; files are not re-hashed."""
    records = []
    for _, prefix in sorted(prefixes(checkpoint_dir).items()):
        manifest = read_manifest(prefix)
        if manifest is not None:
            records.append(CheckpointRecord.from_manifest(prefix, manifest))
    return records


def latest_valid(checkpoint_dir: str) -> CheckpointRecord | None:
    """The newest checkpoint whose manifest verifies; older ones are tried, with a warning, when it does not."""
    for _, prefix in sorted(prefixes(checkpoint_dir).items(), reverse=True):
        problem = verify(prefix)
        if problem is None:
            return CheckpointRecord.from_manifest(prefix, read_manifest(prefix))
        logger.warning("checkpoint %s is not valid: %s; falling back to the previous one", prefix, problem)
    return None
