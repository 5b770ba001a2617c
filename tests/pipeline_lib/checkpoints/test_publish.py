"""Publishing a run to fsspec storage (memory://): checkpoints manifest-last, verified restore, TensorBoard sync."""

from __future__ import annotations

import json
import os
import uuid

import fsspec
import keras
import numpy as np
import pytest
import tensorflow as tf

from pipeline_lib.checkpoints import publish
from pipeline_lib.checkpoints import store as checkpoints
from pipeline_lib.cluster.validation import ClusterInfo
from pipeline_lib.core import storage

MEMORY = fsspec.filesystem("memory")


@pytest.fixture
def remote_dir():
    bucket = f"tfdag-pub-{uuid.uuid4().hex[:8]}"
    yield f"memory://{bucket}/runs/r1/checkpoints"
    if MEMORY.exists(f"/{bucket}"):
        MEMORY.rm(f"/{bucket}", recursive=True)


def _state():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    step = tf.Variable(0, dtype=tf.int64)
    return model, step, tf.train.Checkpoint(model=model, step=step)


def _save(store, step_var, model, step, metrics=None):
    step_var.assign(step)
    model.layers[0].kernel.assign(np.full((3, 2), float(step), np.float32))
    return store.save(step, metrics_fn=lambda: dict(metrics or {}))


def _remote_names(remote_dir: str) -> list[str]:
    root = remote_dir.removeprefix("memory://")
    return sorted(os.path.basename(p) for p in MEMORY.ls(root, detail=False)) if MEMORY.exists(root) else []


def test_publish_uploads_files_then_the_manifest_last(tmp_path, remote_dir, monkeypatch):
    model, step, checkpoint = _state()
    store = checkpoints.CheckpointStore(str(tmp_path), checkpoint)
    record = _save(store, step, model, 5, {"eval_loss": 0.25})
    publisher = publish.CheckpointPublisher(remote_dir)
    order = []
    real_put, real_pipe = type(MEMORY).put_file, type(MEMORY).pipe_file
    monkeypatch.setattr(type(MEMORY), "put_file",
                        lambda self, lpath, rpath, **kw: (order.append(os.path.basename(rpath)),
                                                          real_put(self, lpath, rpath, **kw))[1])
    monkeypatch.setattr(type(MEMORY), "pipe_file",
                        lambda self, path, value, **kw: (order.append(os.path.basename(path)),
                                                         real_pipe(self, path, value, **kw))[1])
    published = publisher.publish(record.path)
    assert order[-1] == "ckpt-5.manifest.json"
    assert sorted(order[:-1]) == ["ckpt-5.data-00000-of-00001", "ckpt-5.index"]
    assert published.path == f"{remote_dir}/ckpt-5" and published.step == 5
    assert published.metrics == {"eval_loss": 0.25}
    assert publisher.list_checkpoints() == [published]


def test_a_crash_mid_upload_never_leaves_a_checkpoint_that_counts(tmp_path, remote_dir, monkeypatch):
    model, step, checkpoint = _state()
    store = checkpoints.CheckpointStore(str(tmp_path), checkpoint, keep=5)
    publisher = publish.CheckpointPublisher(remote_dir, retries=0)
    publisher.publish(_save(store, step, model, 1).path)
    second = _save(store, step, model, 2)
    real_put = type(MEMORY).put_file
    uploads = {"n": 0}

    def dying_put(self, lpath, rpath, **kwargs):
        uploads["n"] += 1
        if uploads["n"] == 2:
            raise ConnectionError("storage went away mid-upload")
        return real_put(self, lpath, rpath, **kwargs)

    monkeypatch.setattr(type(MEMORY), "put_file", dying_put)
    with pytest.raises(publish.PublishError, match="ckpt-2"):
        publisher.publish(second.path)
    monkeypatch.setattr(type(MEMORY), "put_file", real_put)
    # One data file of step 2 is up, its manifest is not: only step 1 counts, and a restore gets step 1.
    assert any(n.startswith("ckpt-2.") for n in _remote_names(remote_dir))
    assert "ckpt-2.manifest.json" not in _remote_names(remote_dir)
    assert [r.step for r in publisher.list_checkpoints()] == [1]
    restored = publisher.restore_latest(str(tmp_path / "restore"))
    assert restored.step == 1 and checkpoints.verify(restored.path) is None
    # The next successful publish cleans the debris away through retention.
    publisher.publish(_save(store, step, model, 3).path)
    publisher.apply_retention(keep=5)
    assert not any(n.startswith("ckpt-2.") for n in _remote_names(remote_dir))


def test_restore_downloads_the_newest_verified_checkpoint(tmp_path, remote_dir, caplog):
    model, step, checkpoint = _state()
    store = checkpoints.CheckpointStore(str(tmp_path / "local"), checkpoint, keep=5)
    publisher = publish.CheckpointPublisher(remote_dir)
    for s in (10, 20, 30):
        publisher.publish(_save(store, step, model, s).path)
    # Damage the newest remote checkpoint: a restore must fall back to step 20.
    root = remote_dir.removeprefix("memory://")
    MEMORY.pipe_file(f"{root}/ckpt-30.data-00000-of-00001", b"garbage")
    local_dir = str(tmp_path / "restore")
    record = publisher.restore_latest(local_dir)
    assert record.step == 20 and record.path == os.path.join(local_dir, "ckpt-20")
    assert checkpoints.verify(record.path) is None
    assert "ckpt-30" in caplog.text and "falling back" in caplog.text
    fresh_model, fresh_step, fresh = _state()
    fresh.read(record.path).assert_existing_objects_matched()
    assert int(fresh_step.numpy()) == 20
    np.testing.assert_array_equal(fresh_model.layers[0].kernel.numpy(), np.full((3, 2), 20.0, np.float32))


def test_restore_of_an_empty_remote_dir_is_none(tmp_path, remote_dir):
    assert publish.CheckpointPublisher(remote_dir).restore_latest(str(tmp_path)) is None


def test_remote_retention_keeps_the_newest_and_the_best(tmp_path, remote_dir):
    model, step, checkpoint = _state()
    store = checkpoints.CheckpointStore(str(tmp_path), checkpoint, keep=10)
    publisher = publish.CheckpointPublisher(remote_dir)
    accuracy = {1: 0.5, 2: 0.9, 3: 0.6, 4: 0.7}
    for s, value in accuracy.items():
        publisher.publish(_save(store, step, model, s, {"eval_accuracy": value}).path)
    kept = publisher.apply_retention(keep=2, best_metric="eval_accuracy", best_mode="max")
    assert [r.step for r in kept] == [2, 3, 4]
    assert [r.step for r in publisher.list_checkpoints()] == [2, 3, 4]
    assert not any(n.startswith("ckpt-1.") for n in _remote_names(remote_dir))


def test_localize_checkpoint_downloads_a_remote_record(tmp_path, remote_dir, monkeypatch):
    monkeypatch.setenv("TFDAG_CACHE_DIR", str(tmp_path / "cache"))
    model, step, checkpoint = _state()
    store = checkpoints.CheckpointStore(str(tmp_path / "local"), checkpoint)
    published = publish.CheckpointPublisher(remote_dir).publish(_save(store, step, model, 7, {"eval_loss": 1.0}).path)
    local = publish.localize_checkpoint(published)
    assert storage.is_local(local.path) and local.path.startswith(str(tmp_path / "cache"))
    assert local.step == 7 and local.metrics == {"eval_loss": 1.0}
    assert checkpoints.verify(local.path) is None
    plain = checkpoints.list_checkpoints(str(tmp_path / "local"))[0]
    assert publish.localize_checkpoint(plain) is plain


def test_tree_sync_uploads_only_what_changed(tmp_path, remote_dir):
    local = tmp_path / "tb"
    (local / "train").mkdir(parents=True)
    (local / "train" / "events.1").write_bytes(b"a")
    sync = publish.TreeSync(str(local), remote_dir.replace("checkpoints", "tensorboard"))
    assert sync.sync() == 1
    assert sync.sync() == 0
    (local / "train" / "events.1").write_bytes(b"ab")
    (local / "eval.1").write_bytes(b"c")
    assert sync.sync() == 2
    root = remote_dir.replace("checkpoints", "tensorboard").removeprefix("memory://")
    assert MEMORY.cat_file(f"{root}/train/events.1") == b"ab"


def test_run_storage_of_a_local_run_writes_in_place(tmp_path):
    run = publish.RunStorage(str(tmp_path / "run"), ClusterInfo())
    assert not run.is_remote and run.local_checkpoint_dir == str(tmp_path / "run" / "checkpoints")
    assert run.prepare_restore() is None and run.sync_tensorboard() == 0


def test_run_storage_of_a_remote_run_mirrors_per_task(tmp_path, remote_dir, monkeypatch):
    monkeypatch.setenv("TFDAG_CACHE_DIR", str(tmp_path / "cache"))
    run_dir = remote_dir.removesuffix("/checkpoints")
    cluster = {"worker": ("127.0.0.1:1", "127.0.0.1:2")}
    chief = publish.RunStorage(run_dir, ClusterInfo(task_type="worker", task_index=0, cluster=cluster))
    other = publish.RunStorage(run_dir, ClusterInfo(task_type="worker", task_index=1, cluster=cluster))
    assert chief.is_remote and chief.local_dir != other.local_dir
    assert chief.checkpoint_dir == f"{run_dir}/checkpoints" and chief.tensorboard_dir == f"{run_dir}/tensorboard"
    assert other.tensorboard_sync is None  # only the chief publishes
    model, step, checkpoint = _state()
    store = checkpoints.CheckpointStore(chief.local_checkpoint_dir, checkpoint, keep=1)
    published = chief.publish_checkpoint(_save(store, step, model, 4), keep=1)
    assert published.path == f"{run_dir}/checkpoints/ckpt-4"
    assert other.publish_checkpoint(None, keep=1) is None
    # Every task restores what the chief published, whatever its own leftovers.
    os.makedirs(other.local_checkpoint_dir, exist_ok=True)
    (open(os.path.join(other.local_checkpoint_dir, "ckpt-9.index"), "wb")).close()
    restored = other.prepare_restore()
    assert restored.step == 4
    assert sorted(os.listdir(other.local_checkpoint_dir)) == [
        "ckpt-4.data-00000-of-00001", "ckpt-4.index", "ckpt-4.manifest.json"]
    assert [r.path for r in chief.checkpoint_records()] == [f"{run_dir}/checkpoints/ckpt-4"]
    manifest = json.loads(MEMORY.cat_file(f"{run_dir.removeprefix('memory://')}/checkpoints/ckpt-4.manifest.json"))
    assert manifest["step"] == 4
