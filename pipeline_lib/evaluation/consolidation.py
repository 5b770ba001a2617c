"""Checkpoint consolidation: pick the best (or latest) checkpoint, prove it restores, export it with checksums."""

from __future__ import annotations

import datetime
import json
import logging
import os
import shutil
import tempfile

import keras
import tensorflow as tf
from pydantic import BaseModel, ConfigDict

from pipeline_lib.checkpoints import manifests, publish, run_storage, selection
from pipeline_lib.checkpoints.records import CheckpointRecord
from pipeline_lib.config import PipelineConfig
from pipeline_lib.core import digests, storage
from pipeline_lib.core.digests import DigestAlgorithm
from pipeline_lib.core.errors import TfdagError
from pipeline_lib.data.manifest import Manifest
from pipeline_lib.data.statistics import load_statistics
from pipeline_lib.serving import signatures
from pipeline_lib.training import models
from pipeline_lib.training.results import TrainResult

logger = logging.getLogger(__name__)

KERAS_NAME = "model.keras"
SAVED_MODEL_NAME = "saved_model"
EXPORT_MANIFEST_NAME = "export_manifest.json"


class ConsolidationError(TfdagError, RuntimeError):
    """No checkpoint can be selected, verified or restored; the message names it and the fix."""


class ExportResult(BaseModel):
    """The exported model of one run and the checkpoint it came from."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    checkpoint_step: int
    checkpoint_path: str
    checkpoint_metrics: dict[str, float] = {}
    selected_by: str  # e.g. "best eval_accuracy (max)" or "latest"
    export_dir: str
    keras_path: str
    saved_model_dir: str
    manifest_path: str
    files: dict[str, str]  # path relative to export_dir -> sha256


def rank_checkpoints(config: PipelineConfig, records: tuple[CheckpointRecord, ...] | list[CheckpointRecord]
                     ) -> list[tuple[CheckpointRecord, str]]:
    """The checkpoints in order of preference, each with why it ranks there.

    `select: latest` (or no checkpoint carrying the metric) orders newest first; `select: best` orders by the
    selection metric, newest first among ties, then the checkpoints without the metric, newest first.
    """
    newest_first = sorted(records, key=lambda r: r.step, reverse=True)
    if config.evaluation.select == "latest":
        return [(r, "latest") for r in newest_first]
    metric, direction = selection.selection_metric(config)
    best = selection.rank_by_metric(records, metric, direction)
    if not best:
        logger.warning("no checkpoint records %s; selecting the latest instead of the best", metric)
        return [(r, f"latest (no checkpoint records {metric})") for r in newest_first]
    unscored = [r for r in newest_first if metric not in r.metrics]
    label = f"best {metric} ({direction.value})"
    return [(r, label) for r in best] + [(r, f"latest without {metric}") for r in unscored]


def restore_model(config: PipelineConfig, manifest: Manifest, record: CheckpointRecord) -> keras.Model:
    """Rebuild the configured model and restore its weights from a checkpoint, proving every weight matched.

    Raises:
        ConsolidationError: when the checkpoint fails verification or does not match the model.
    """
    try:
        # TensorFlow reads local files only: a remote run's checkpoint is downloaded and verified first.
        local = run_storage.localize_checkpoint(record, config.storage_options)
    except publish.PublishError as error:
        raise ConsolidationError(f"checkpoint {record.path} (step {record.step}) cannot be fetched: {error}") from error
    problem = manifests.verify(local.path)
    if problem is not None:
        raise ConsolidationError(f"checkpoint {record.path} (step {record.step}) is not valid: {problem}")
    model = models.create_model(config.model, manifest.feature_schema,
                                load_statistics(manifest, config.storage_options))
    try:
        status = tf.train.Checkpoint(model=model).read(local.path)
        # Every model variable must come from the checkpoint; the optimizer, step and RNG in it are left unread,
        # which is expected: a partial restore, not one to warn about value by value.
        status.assert_existing_objects_matched()
        status.expect_partial()
    except (AssertionError, ValueError, tf.errors.OpError) as error:
        raise ConsolidationError(
            f"checkpoint {record.path} (step {record.step}) does not restore into the model built from "
            f"model.factory {config.model.factory!r} with params {dict(config.model.params)} ({error}); "
            "consolidate with the model config the run was trained with"
        ) from error
    return model


def _export_saved_model(model: keras.Model, manifest: Manifest, saved_model_dir: str, task) -> None:
    """The SavedModel on raw features (`serving.signatures`): `serving_default` and `serve_examples`."""
    signatures.export_saved_model(model, manifest.feature_schema, task, saved_model_dir)


def _file_hashes(local_dir: str) -> dict[str, str]:
    return {rel.replace(os.sep, "/"): digests.local_file_digest(os.path.join(local_dir, rel), DigestAlgorithm.SHA256)
            for rel in storage.iter_files(local_dir) if rel != EXPORT_MANIFEST_NAME}


def consolidate(config: PipelineConfig, manifest: Manifest, train_result: TrainResult,
                export_dir: str) -> ExportResult:
    """Select a checkpoint, prove it restores, export `model.keras` and a SavedModel, then the manifest last.

    A checkpoint that fails verification or restore is skipped (with a warning) for the next in rank.
    `export_dir` may be any fsspec URI: remote exports are written locally first and uploaded, the manifest
    after every other file, so an export without `export_manifest.json` is never complete.

    Args:
        config: the pipeline config (model, evaluation.select, evaluation.gate).
        manifest: the dataset manifest (its schema builds the model and the serving signature).
        train_result: the chief's TrainResult listing the checkpoints.
        export_dir: where the export goes.

    Returns:
        The ExportResult with the sha256 of every exported file.

    Raises:
        ConsolidationError: when there is no checkpoint, or none restores.
    """
    if not train_result.checkpoints:
        raise ConsolidationError(
            f"training run {train_result.run_dir} lists no checkpoints in {train_result.checkpoint_dir}; "
            "consolidate the chief's TrainResult of a run that finished at least one checkpoint"
        )
    problems = []
    for record, reason in rank_checkpoints(config, train_result.checkpoints):
        try:
            model = restore_model(config, manifest, record)
        except ConsolidationError as error:
            logger.warning("skipping checkpoint: %s", error)
            problems.append(str(error))
            continue
        logger.info("selected checkpoint %s (step %d, %s, metrics %s)", record.path, record.step, reason,
                    record.metrics)
        return _export(model, manifest, record, reason, export_dir, config)
    raise ConsolidationError("no checkpoint of the run restores:\n  - " + "\n  - ".join(problems))


def _export(model: keras.Model, manifest: Manifest, record: CheckpointRecord, reason: str, export_dir: str,
            config: PipelineConfig) -> ExportResult:
    fs, root = storage.get_fs(export_dir, config.storage_options)
    manifest_path = storage.join(export_dir, EXPORT_MANIFEST_NAME)
    # An older manifest goes first, so an export overwritten halfway never looks complete.
    if fs.exists(storage.join(root, EXPORT_MANIFEST_NAME)):
        fs.rm(storage.join(root, EXPORT_MANIFEST_NAME))
    local = storage.is_local(export_dir)
    staging = storage.local_path(export_dir) if local else tempfile.mkdtemp(prefix="tfdag-export-")
    try:
        os.makedirs(staging, exist_ok=True)
        keras_local = os.path.join(staging, KERAS_NAME)
        saved_local = os.path.join(staging, SAVED_MODEL_NAME)
        if os.path.exists(saved_local):
            shutil.rmtree(saved_local)
        model.save(keras_local)
        _export_saved_model(model, manifest, saved_local, config.model.task)
        files = _file_hashes(staging)
        if not local:
            storage.upload_tree(staging, fs, root, skip=(EXPORT_MANIFEST_NAME,))
    finally:
        if not local:
            shutil.rmtree(staging, ignore_errors=True)
    payload = {
        "checkpoint": {"step": record.step, "path": record.path, "metrics": record.metrics},
        "selected_by": reason,
        "keras_path": KERAS_NAME,
        "saved_model_dir": SAVED_MODEL_NAME,
        "signatures": [signatures.SERVING_SIGNATURE, signatures.EXAMPLES_SIGNATURE],
        "inputs": {name: {"shape": list(spec.shape), "dtype": spec.dtype.name}
                   for name, spec in signatures.raw_signature(manifest.feature_schema).items()},
        "data_fingerprint": manifest.fingerprint,
        "tensorflow_version": tf.__version__,
        "keras_version": keras.__version__,
        "created_at": datetime.datetime.now(datetime.UTC).isoformat(),
        "files": files,
    }
    # Written last: its presence means every file above is complete.
    storage.write_bytes_atomic(fs, storage.join(root, EXPORT_MANIFEST_NAME),
                               json.dumps(payload, indent=2, sort_keys=True).encode())
    logger.info("exported step %d to %s (%d files)", record.step, export_dir, len(files))
    return ExportResult(
        checkpoint_step=record.step, checkpoint_path=record.path, checkpoint_metrics=record.metrics,
        selected_by=reason, export_dir=export_dir, keras_path=storage.join(export_dir, KERAS_NAME),
        saved_model_dir=storage.join(export_dir, SAVED_MODEL_NAME), manifest_path=manifest_path, files=files,
    )


def verify_export(export_dir: str, storage_options: dict | None = None) -> list[str]:
    """Problems with an export: a missing manifest, or files whose sha256 differs from it (empty: intact)."""
    fs, root = storage.get_fs(export_dir, storage_options)
    manifest_file = storage.join(root, EXPORT_MANIFEST_NAME)
    if not fs.exists(manifest_file):
        return [f"{EXPORT_MANIFEST_NAME} is missing in {export_dir}: the export did not finish"]
    recorded = json.loads(fs.cat_file(manifest_file))["files"]
    problems = []
    for relative, digest in sorted(recorded.items()):
        path = storage.join(root, relative)
        if not fs.exists(path):
            problems.append(f"{relative} is missing")
        elif digests.file_digest(fs, path, DigestAlgorithm.SHA256) != digest:
            problems.append(f"{relative} does not match its sha256 in {EXPORT_MANIFEST_NAME}")
    return problems
