"""Consolidation: best vs latest selection, proven restore, export that reloads alike, manifest checksums last."""

from __future__ import annotations

import json
import os
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

from pipeline_lib.checkpoints import manifests
from pipeline_lib.checkpoints.records import CheckpointRecord
from pipeline_lib.checkpoints.store import CheckpointStore
from pipeline_lib.config import parse_config
from pipeline_lib.core.digests import DigestAlgorithm, local_file_digest
from pipeline_lib.evaluation import consolidation
from pipeline_lib.evaluation import metrics as evaluation
from pipeline_lib.serving import rows, signatures, tfdag_scoring
from pipeline_lib.training import input_pipeline, models
from pipeline_lib.training import loop as training
from pipeline_lib.training.results import TrainResult
from tests.conftest import make_plan


def _config(tmp_path, **evaluation_section):
    return parse_config({
        "data": {"source": "unused.csv", "label": "label"},
        "output_root": str(tmp_path),
        "model": {"params": {"hidden_units": [8]}},
        "evaluation": evaluation_section,
        "train": {"strategy": "default", "cpu_replicas": 1},
    })


def _train_result(run_dir: str, checkpoint_dir: str) -> TrainResult:
    return TrainResult(
        run_dir=run_dir, strategy="default", strategy_reason="test", num_workers=1, num_replicas=1,
        per_replica_batch_size=8, global_batch_size=8, base_learning_rate=1e-3, scaled_learning_rate=1e-3,
        lr_scaling="linear", steps_per_epoch=1, total_steps=3, final_step=3, final_loss=0.0,
        checkpoint_dir=checkpoint_dir, checkpoints=tuple(manifests.list_checkpoints(checkpoint_dir)),
        tensorboard_dir=os.path.join(run_dir, "tensorboard"))


@pytest.fixture
def saved_run(tmp_path, tiny_manifest):
    """Three checkpoints with different weights: eval_accuracy best at step 2, eval_loss best at step 3."""
    config = _config(tmp_path)
    model = models.create_model(config.model, tiny_manifest.feature_schema)
    optimizer = keras.optimizers.Adam()
    optimizer.build(model.trainable_variables)
    step = tf.Variable(0, dtype=tf.int64)
    store = CheckpointStore(str(tmp_path / "run" / "checkpoints"),
                                        tf.train.Checkpoint(model=model, optimizer=optimizer, step=step), keep=3)
    rng = np.random.default_rng(0)
    weights = {}
    metrics = {1: {"eval_accuracy": 0.5, "eval_loss": 0.9}, 2: {"eval_accuracy": 0.9, "eval_loss": 0.6},
               3: {"eval_accuracy": 0.7, "eval_loss": 0.4}}
    for at_step, values in metrics.items():
        model.set_weights([rng.normal(size=w.shape).astype(np.float32) for w in model.get_weights()])
        step.assign(at_step)
        weights[at_step] = [w.copy() for w in model.get_weights()]
        store.save(at_step, metrics_fn=lambda values=values: values)
    result = _train_result(str(tmp_path / "run"), store.checkpoint_dir)
    return config, result, weights


def _first_batch(manifest):
    inputs, _ = next(iter(input_pipeline.create_dataset(manifest, "eval", 16)))
    return inputs


def _assert_weights(model, expected):
    for got, want in zip(model.get_weights(), expected):
        np.testing.assert_array_equal(got, want)


def test_best_checkpoint_is_restored_and_exported(saved_run, tiny_manifest, tmp_path):
    config, result, weights = saved_run
    export_dir = str(tmp_path / "export")

    export = consolidation.consolidate(config, tiny_manifest, result, export_dir)

    assert export.checkpoint_step == 2
    assert export.selected_by == "best eval_accuracy (max)"
    assert export.checkpoint_metrics["eval_accuracy"] == 0.9
    restored = consolidation.restore_model(config, tiny_manifest, result.checkpoints[1])
    _assert_weights(restored, weights[2])
    # The .keras file gives the restored model's predictions; the SavedModel's signatures give them on raw
    # columns (serving_default) and on serialized Examples (serve_examples).
    inputs = _first_batch(tiny_manifest)
    expected = restored(inputs, training=False).numpy()
    reloaded = keras.saving.load_model(export.keras_path, compile=False)
    _assert_weights(reloaded, weights[2])
    np.testing.assert_allclose(reloaded(inputs, training=False).numpy(), expected, rtol=1e-6, atol=1e-6)
    served = tf.saved_model.load(export.saved_model_dir)
    frame = rows.raw_rows(tiny_manifest, 16)
    columns = tfdag_scoring.Scorer(export.saved_model_dir).to_tensors(frame)
    by_input = {signatures.input_names(tiny_manifest.feature_schema)[name]: tf.constant(value)
                for name, value in columns.items()}
    outputs = served.signatures["serving_default"](**by_input)
    probabilities = tf.nn.softmax(expected).numpy()
    np.testing.assert_allclose(outputs["probabilities"].numpy(), probabilities, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(outputs["prediction"].numpy(), probabilities.argmax(axis=1))
    eval_file = input_pipeline.shard_uris(tiny_manifest, "eval")[0]
    serialized = tf.constant([r.numpy() for r in tf.data.TFRecordDataset(eval_file).take(16)])
    from_examples = served.signatures["serve_examples"](examples=serialized)
    np.testing.assert_allclose(from_examples["probabilities"].numpy(), probabilities, rtol=1e-6, atol=1e-6)


def test_export_manifest_lists_every_file_with_its_sha256(saved_run, tiny_manifest, tmp_path):
    config, result, _ = saved_run
    export = consolidation.consolidate(config, tiny_manifest, result, str(tmp_path / "export"))

    on_disk = {os.path.relpath(os.path.join(root, name), export.export_dir).replace(os.sep, "/")
               for root, _dirs, names in os.walk(export.export_dir) for name in names}
    assert on_disk - set(export.files) == {consolidation.EXPORT_MANIFEST_NAME}
    assert {"model.keras", "saved_model/saved_model.pb"} <= set(export.files)
    payload = json.loads(Path(export.manifest_path).read_text())
    assert payload["files"] == export.files
    assert payload["checkpoint"]["step"] == 2
    for relative, digest in export.files.items():
        assert local_file_digest(os.path.join(export.export_dir, relative), DigestAlgorithm.SHA256) == digest
    assert consolidation.verify_export(export.export_dir) == []
    # The manifest is the newest file of the export.
    manifest_mtime = os.stat(export.manifest_path).st_mtime_ns
    assert all(os.stat(os.path.join(export.export_dir, r)).st_mtime_ns <= manifest_mtime for r in export.files)

    with open(export.keras_path, "ab") as handle:
        handle.write(b"tampered")
    assert consolidation.verify_export(export.export_dir) == [
        "model.keras does not match its sha256 in export_manifest.json"]


def test_manifest_is_written_last(saved_run, tiny_manifest, tmp_path, monkeypatch):
    config, result, _ = saved_run
    export_dir = str(tmp_path / "export")
    consolidation.consolidate(config, tiny_manifest, result, export_dir)
    assert os.path.exists(os.path.join(export_dir, consolidation.EXPORT_MANIFEST_NAME))

    def crash(*args, **kwargs):
        raise OSError("disk full while writing the SavedModel")

    monkeypatch.setattr(consolidation, "_export_saved_model", crash)
    with pytest.raises(OSError, match="disk full"):
        consolidation.consolidate(config, tiny_manifest, result, export_dir)
    # A re-export that died midway leaves no manifest, not the old one beside half-new files.
    assert not os.path.exists(os.path.join(export_dir, consolidation.EXPORT_MANIFEST_NAME))
    assert consolidation.verify_export(export_dir)[0].startswith("export_manifest.json is missing")


def test_latest_and_loss_selection(saved_run, tiny_manifest, tmp_path):
    _, result, weights = saved_run
    latest = consolidation.consolidate(_config(tmp_path, select="latest"), tiny_manifest, result,
                                       str(tmp_path / "latest"))
    assert (latest.checkpoint_step, latest.selected_by) == (3, "latest")
    by_loss = consolidation.consolidate(_config(tmp_path, gate={"metric": "loss"}), tiny_manifest, result,
                                        str(tmp_path / "loss"))
    assert (by_loss.checkpoint_step, by_loss.selected_by) == (3, "best eval_loss (min)")
    _assert_weights(keras.saving.load_model(latest.keras_path, compile=False), weights[3])


def test_selection_falls_back_to_latest_without_metrics(tmp_path):
    config = _config(tmp_path)
    records = [CheckpointRecord(step=s, path=f"/x/ckpt-{s}") for s in (5, 10)]
    ranked = consolidation.rank_checkpoints(config, records)
    assert [(r.step, why) for r, why in ranked] == [
        (10, "latest (no checkpoint records eval_accuracy)"), (5, "latest (no checkpoint records eval_accuracy)")]
    tied = [CheckpointRecord(step=s, path=f"/x/ckpt-{s}", metrics={"eval_accuracy": 0.8}) for s in (5, 10)]
    assert consolidation.rank_checkpoints(config, tied)[0][0].step == 10  # ties go to the newest


def test_a_corrupt_best_checkpoint_is_skipped(saved_run, tiny_manifest, tmp_path, caplog):
    config, result, weights = saved_run
    data_file = next(p for p in tf.io.gfile.glob(result.checkpoints[1].path + ".data-*"))
    with open(data_file, "r+b") as handle:
        handle.write(b"\0\0\0\0")

    export = consolidation.consolidate(config, tiny_manifest, result, str(tmp_path / "export"))

    assert export.checkpoint_step == 3  # the next best by eval_accuracy (0.7)
    assert "ckpt-2" in caplog.text and "sha256" in caplog.text
    _assert_weights(keras.saving.load_model(export.keras_path, compile=False), weights[3])


def test_restore_into_a_different_model_is_refused(saved_run, tiny_manifest, tmp_path):
    _, result, _ = saved_run
    other = parse_config({"data": {"source": "unused.csv", "label": "label"}, "output_root": str(tmp_path),
                          "model": {"params": {"hidden_units": [8, 4]}}})
    with pytest.raises(consolidation.ConsolidationError, match="does not restore into the model"):
        consolidation.restore_model(other, tiny_manifest, result.checkpoints[0])
    with pytest.raises(consolidation.ConsolidationError, match="no checkpoint of the run restores"):
        consolidation.consolidate(other, tiny_manifest, result, str(tmp_path / "export"))


def test_no_checkpoints_names_the_run(tmp_path, tiny_manifest):
    result = _train_result(str(tmp_path / "empty"), str(tmp_path / "empty" / "checkpoints"))
    with pytest.raises(consolidation.ConsolidationError, match="lists no checkpoints"):
        consolidation.consolidate(_config(tmp_path), tiny_manifest, result, str(tmp_path / "export"))


@pytest.mark.slow
def test_trained_run_consolidates_and_evaluates_like_the_training_loop(tmp_path, tiny_manifest):
    config = parse_config({
        "data": {"source": "unused.csv", "label": "label"},
        "output_root": str(tmp_path),
        "model": {"params": {"hidden_units": [16]}},
        "train": {"strategy": "default", "cpu_replicas": 1, "epochs": 2, "checkpoint_every_steps": 4,
                  "per_replica_batch_size": 32, "base_learning_rate": 0.01, "log_every_steps": 4},
    })
    plan = make_plan(tiny_manifest, per_replica_batch_size=32, epochs=2)
    result = training.train(config, tiny_manifest, plan, str(tmp_path / "run"))

    export = consolidation.consolidate(config, tiny_manifest, result, str(tmp_path / "run" / "export"))
    report = evaluation.evaluate(config, tiny_manifest, export.keras_path)

    best = max(result.checkpoints, key=lambda r: (r.metrics["eval_accuracy"], r.step))
    assert export.checkpoint_step == best.step
    # The training loop's own eval of that checkpoint and the exported model's evaluation agree.
    assert report.metrics["accuracy"] == pytest.approx(best.metrics["eval_accuracy"], abs=1e-6)
    assert report.metrics["loss"] == pytest.approx(best.metrics["eval_loss"], rel=1e-4)
