"""Tests for pipeline_lib.checkpoints.publish on memory:// storage: manifest last, verified fetch, retention."""

from __future__ import annotations

import os

import fsspec
import numpy as np
import pytest

from pipeline_lib.checkpoints import manifests, publish
from pipeline_lib.checkpoints import store as checkpoints
from pipeline_lib.config import Direction
from tests.pipeline_lib.checkpoints.checkpoint_support import create_state, save_at

MEMORY = fsspec.filesystem("memory")








def _remote_names(remote_dir: str) -> list[str]:
    root = remote_dir.removeprefix("memory://")
    return sorted(os.path.basename(p) for p in MEMORY.ls(root, detail=False)) if MEMORY.exists(root) else []


def test_publish_uploads_files_then_the_manifest_last(tmp_path, remote_dir, monkeypatch):
    model, step, checkpoint = create_state()
    store = checkpoints.CheckpointStore(str(tmp_path), checkpoint)
    record = save_at(store, step, model, 5, {"eval_loss": 0.25})
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
    model, step, checkpoint = create_state()
    store = checkpoints.CheckpointStore(str(tmp_path), checkpoint, keep=5)
    publisher = publish.CheckpointPublisher(remote_dir, retries=0)
    publisher.publish(save_at(store, step, model, 1).path)
    second = save_at(store, step, model, 2)
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
    assert restored.step == 1 and manifests.verify(restored.path) is None
    # The next successful publish cleans the debris away through retention.
    publisher.publish(save_at(store, step, model, 3).path)
    publisher.apply_retention(keep=5)
    assert not any(n.startswith("ckpt-2.") for n in _remote_names(remote_dir))


def test_restore_downloads_the_newest_verified_checkpoint(tmp_path, remote_dir, caplog):
    model, step, checkpoint = create_state()
    store = checkpoints.CheckpointStore(str(tmp_path / "local"), checkpoint, keep=5)
    publisher = publish.CheckpointPublisher(remote_dir)
    for s in (10, 20, 30):
        publisher.publish(save_at(store, step, model, s).path)
    # Damage the newest remote checkpoint: a restore must fall back to step 20.
    root = remote_dir.removeprefix("memory://")
    MEMORY.pipe_file(f"{root}/ckpt-30.data-00000-of-00001", b"garbage")
    local_dir = str(tmp_path / "restore")
    record = publisher.restore_latest(local_dir)
    assert record.step == 20 and record.path == os.path.join(local_dir, "ckpt-20")
    assert manifests.verify(record.path) is None
    assert "ckpt-30" in caplog.text and "falling back" in caplog.text
    fresh_model, fresh_step, fresh = create_state()
    fresh.read(record.path).assert_existing_objects_matched()
    assert int(fresh_step.numpy()) == 20
    np.testing.assert_array_equal(fresh_model.layers[0].kernel.numpy(), np.full((3, 2), 20.0, np.float32))


def test_restore_of_an_empty_remote_dir_is_none(tmp_path, remote_dir):
    assert publish.CheckpointPublisher(remote_dir).restore_latest(str(tmp_path)) is None


def test_remote_retention_keeps_the_newest_and_the_best(tmp_path, remote_dir):
    model, step, checkpoint = create_state()
    store = checkpoints.CheckpointStore(str(tmp_path), checkpoint, keep=10)
    publisher = publish.CheckpointPublisher(remote_dir)
    accuracy = {1: 0.5, 2: 0.9, 3: 0.6, 4: 0.7}
    for s, value in accuracy.items():
        publisher.publish(save_at(store, step, model, s, {"eval_accuracy": value}).path)
    kept = publisher.apply_retention(keep=2, best_metric="eval_accuracy",
                                     best_direction=Direction.MAX)
    assert [r.step for r in kept] == [2, 3, 4]
    assert [r.step for r in publisher.list_checkpoints()] == [2, 3, 4]
    assert not any(n.startswith("ckpt-1.") for n in _remote_names(remote_dir))


def test_a_damaged_remote_file_is_refused_without_retry(tmp_path, remote_dir, monkeypatch):
    model, step, checkpoint = create_state()
    store = checkpoints.CheckpointStore(str(tmp_path / "local"), checkpoint)
    publisher = publish.CheckpointPublisher(remote_dir)
    publisher.publish(save_at(store, step, model, 3).path)
    root = remote_dir.removeprefix("memory://")
    MEMORY.pipe_file(f"{root}/ckpt-3.index", b"garbage")
    opened = []
    real_open = type(MEMORY)._open
    monkeypatch.setattr(type(MEMORY), "_open", lambda self, path, *a, **kw: (opened.append(path),
                                                                                real_open(self, path, *a, **kw))[1])
    with pytest.raises(publish.PublishError, match=r"ckpt-3\.index has sha256 .* damaged"):
        publisher.fetch(3, str(tmp_path / "restore"))
    assert sum(p.endswith("ckpt-3.index") for p in opened) == 1
    assert not [n for n in os.listdir(tmp_path / "restore") if n.startswith("ckpt-3.index")]
