"""Tests for pipeline_lib.checkpoints.tree_sync: only new and changed files are uploaded."""

from __future__ import annotations

import fsspec

from pipeline_lib.checkpoints.tree_sync import TreeSync

MEMORY = fsspec.filesystem("memory")




def test_tree_sync_uploads_only_what_changed(tmp_path, remote_dir):
    local = tmp_path / "tb"
    (local / "train").mkdir(parents=True)
    (local / "train" / "events.1").write_bytes(b"a")
    sync = TreeSync(str(local), remote_dir.replace("checkpoints", "tensorboard"))
    assert sync.sync() == 1
    assert sync.sync() == 0
    (local / "train" / "events.1").write_bytes(b"ab")
    (local / "eval.1").write_bytes(b"c")
    assert sync.sync() == 2
    root = remote_dir.replace("checkpoints", "tensorboard").removeprefix("memory://")
    assert MEMORY.cat_file(f"{root}/train/events.1") == b"ab"
