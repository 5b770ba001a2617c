"""Tests for pipeline_lib.checkpoints.run_storage: per-task local mirrors of a remote run, publish, restore."""

from __future__ import annotations

import json
import os

import fsspec

from pipeline_lib.checkpoints import manifests, publish, run_storage
from pipeline_lib.checkpoints import store as checkpoints
from pipeline_lib.cluster.info import ClusterInfo
from pipeline_lib.core import storage
from tests.pipeline_lib.checkpoints.checkpoint_support import create_state, save_at

MEMORY = fsspec.filesystem("memory")








def test_localize_checkpoint_downloads_a_remote_record(tmp_path, remote_dir, monkeypatch):
    monkeypatch.setenv("TFDAG_CACHE_DIR", str(tmp_path / "cache"))
    model, step, checkpoint = create_state()
    store = checkpoints.CheckpointStore(str(tmp_path / "local"), checkpoint)
    published = publish.CheckpointPublisher(remote_dir).publish(save_at(store, step, model, 7, {"eval_loss": 1.0}).path)
    local = run_storage.localize_checkpoint(published)
    assert storage.is_local(local.path) and local.path.startswith(str(tmp_path / "cache"))
    assert local.step == 7 and local.metrics == {"eval_loss": 1.0}
    assert manifests.verify(local.path) is None
    plain = manifests.list_checkpoints(str(tmp_path / "local"))[0]
    assert run_storage.localize_checkpoint(plain) is plain


def test_run_storage_of_a_local_run_writes_in_place(tmp_path):
    run = run_storage.RunStorage(str(tmp_path / "run"), ClusterInfo())
    assert not run.is_remote and run.local_checkpoint_dir == str(tmp_path / "run" / "checkpoints")
    assert run.prepare_restore() is None and run.sync_tensorboard() == 0


def test_run_storage_of_a_remote_run_mirrors_per_task(tmp_path, remote_dir, monkeypatch):
    monkeypatch.setenv("TFDAG_CACHE_DIR", str(tmp_path / "cache"))
    run_dir = remote_dir.removesuffix("/checkpoints")
    cluster = {"worker": ("127.0.0.1:1", "127.0.0.1:2")}
    chief = run_storage.RunStorage(run_dir, ClusterInfo(task_type="worker", task_index=0, cluster=cluster))
    other = run_storage.RunStorage(run_dir, ClusterInfo(task_type="worker", task_index=1, cluster=cluster))
    assert chief.is_remote and chief.local_dir != other.local_dir
    assert chief.checkpoint_dir == f"{run_dir}/checkpoints" and chief.tensorboard_dir == f"{run_dir}/tensorboard"
    assert other.tensorboard_sync is None  # only the chief publishes
    model, step, checkpoint = create_state()
    store = checkpoints.CheckpointStore(chief.local_checkpoint_dir, checkpoint, keep=1)
    published = chief.publish_checkpoint(save_at(store, step, model, 4), keep=1)
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
