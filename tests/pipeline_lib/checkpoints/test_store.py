"""Tests for pipeline_lib.checkpoints.store (and the manifests it writes): manifest last, verified restore, retention."""

from __future__ import annotations

import json
import logging
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from pipeline_lib.checkpoints import manifests
from pipeline_lib.checkpoints import store as checkpoints
from pipeline_lib.cluster.info import ClusterInfo
from pipeline_lib.config import Direction


def _state():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    optimizer = keras.optimizers.Adam(0.1)
    optimizer.build(model.trainable_variables)
    step = tf.Variable(0, dtype=tf.int64)
    return model, optimizer, step, tf.train.Checkpoint(model=model, optimizer=optimizer, step=step)


def _save_steps(store, step_var, model, steps, metrics=None):
    records = []
    for step in steps:
        step_var.assign(step)
        model.layers[0].kernel.assign(np.full((3, 2), float(step), np.float32))
        value = (metrics or {}).get(step, {})
        records.append(store.save(step, metrics_fn=lambda v=value: v))
    return records


def test_manifest_lists_every_file_with_its_checksum(tmp_path):
    model, _, step, checkpoint = _state()
    store = checkpoints.CheckpointStore(str(tmp_path), checkpoint)
    record = _save_steps(store, step, model, [7], {7: {"eval_loss": 0.5}})[0]
    assert record.path == str(tmp_path / "ckpt-7") and record.metrics == {"eval_loss": 0.5}
    manifest = json.loads((tmp_path / "ckpt-7.manifest.json").read_text())
    names = sorted(entry["name"] for entry in manifest["files"])
    assert names == ["ckpt-7.data-00000-of-00001", "ckpt-7.index"]
    assert manifest["step"] == 7
    assert manifests.verify(record.path) is None
    assert tf.train.latest_checkpoint(str(tmp_path)) == record.path
    assert manifests.list_checkpoints(str(tmp_path)) == [record]


def test_manifest_is_written_last(tmp_path):
    model, _, step, checkpoint = _state()
    store = checkpoints.CheckpointStore(str(tmp_path), checkpoint)
    _save_steps(store, step, model, [1])

    def crash():
        # The data files exist now; the manifest must not.
        assert os.path.exists(tmp_path / "ckpt-2.index")
        assert not os.path.exists(tmp_path / "ckpt-2.manifest.json")
        raise RuntimeError("killed mid-save")

    with pytest.raises(RuntimeError, match="killed mid-save"):
        store.save(2, metrics_fn=crash)
    assert not os.path.exists(tmp_path / "ckpt-2.manifest.json")
    assert store.latest_valid().step == 1


def test_corrupt_data_file_falls_back_with_a_warning(tmp_path, caplog):
    model, _, step, checkpoint = _state()
    store = checkpoints.CheckpointStore(str(tmp_path), checkpoint)
    _save_steps(store, step, model, [10, 20])
    data = tmp_path / "ckpt-20.data-00000-of-00001"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING, logger="pipeline_lib.checkpoints.manifests"):
        record = store.restore_latest()
    assert record.step == 10
    assert "ckpt-20" in caplog.text and "sha256" in caplog.text and "falling back" in caplog.text
    assert int(step.numpy()) == 10
    np.testing.assert_array_equal(model.layers[0].kernel.numpy(), np.full((3, 2), 10.0))


def test_missing_manifest_falls_back(tmp_path, caplog):
    model, _, step, checkpoint = _state()
    store = checkpoints.CheckpointStore(str(tmp_path), checkpoint)
    _save_steps(store, step, model, [1, 2])
    os.remove(tmp_path / "ckpt-2.manifest.json")
    with caplog.at_level(logging.WARNING):
        assert store.latest_valid().step == 1
    assert "no readable manifest" in caplog.text
    assert manifests.latest_valid(str(tmp_path / "empty")) is None


def test_retention_keeps_the_newest_and_the_best(tmp_path):
    model, _, step, checkpoint = _state()
    store = checkpoints.CheckpointStore(str(tmp_path), checkpoint, keep=2, best_metric="eval_accuracy",
                                        best_direction=Direction.MAX)
    metrics = {1: {"eval_accuracy": 0.9}, 2: {"eval_accuracy": 0.5}, 3: {"eval_accuracy": 0.6},
               4: {"eval_accuracy": 0.7}, 5: {"eval_accuracy": 0.8}}
    _save_steps(store, step, model, [1, 2, 3, 4, 5], metrics)
    assert [r.step for r in manifests.list_checkpoints(str(tmp_path))] == [1, 4, 5]
    assert sorted(os.listdir(tmp_path)) == sorted(
        ["checkpoint"] + [f"ckpt-{s}.{ext}" for s in (1, 4, 5)
                          for ext in ("index", "data-00000-of-00001", "manifest.json")])
    assert store.best().step == 1


def test_model_alone_restores_from_the_model_key(tmp_path):
    model, _, step, checkpoint = _state()
    store = checkpoints.CheckpointStore(str(tmp_path), checkpoint)
    record = _save_steps(store, step, model, [3])[0]
    fresh = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    tf.train.Checkpoint(model=fresh).restore(record.path).expect_partial()
    np.testing.assert_array_equal(fresh.layers[0].kernel.numpy(), np.full((3, 2), 3.0))


def test_non_chief_saves_into_a_scratch_dir_it_removes(tmp_path):
    *_, checkpoint = _state()
    worker = ClusterInfo(task_type="worker", task_index=1, cluster={"worker": ("a:1", "b:2")})
    store = checkpoints.CheckpointStore(str(tmp_path), checkpoint, cluster=worker)
    assert store.save(5) is None
    assert not os.path.exists(tmp_path / ".scratch" / "worker-1")
    assert manifests.list_checkpoints(str(tmp_path)) == []


def test_mismatched_checkpoint_names_the_fix(tmp_path):
    model, _, step, checkpoint = _state()
    record = _save_steps(checkpoints.CheckpointStore(str(tmp_path), checkpoint), step, model, [1])[0]
    other = keras.Sequential([keras.Input((3,)), keras.layers.Dense(5)])
    store = checkpoints.CheckpointStore(str(tmp_path), tf.train.Checkpoint(model=other))
    with pytest.raises(checkpoints.CheckpointError, match="fresh run_dir"):
        store.restore(record)
