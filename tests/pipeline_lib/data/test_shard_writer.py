"""Shard writing: roll-over at the target size, and a failed background write publishes nothing."""

from __future__ import annotations

import os

import pytest

from pipeline_lib.config import DataConfig
from pipeline_lib.core import digests
from pipeline_lib.data import shard_writer
from pipeline_lib.data.convert import convert
from pipeline_lib.data.errors import ConversionError
from pipeline_lib.data.manifest import MANIFEST_NAME
from tests.pipeline_lib.data.conversion_support import make_rows, read_all, write_csv


def test_shards_roll_over_at_target_size_and_glob_of_several_files(tmp_path):
    (tmp_path / "raw").mkdir()
    all_rows = make_rows(3000, seed=3)
    for k in range(3):
        write_csv(tmp_path / "raw" / f"part{k}.csv", all_rows[k * 1000 : (k + 1) * 1000])
    (tmp_path / "raw" / "notes.txt").write_text("ignored: not matched by the glob")
    data = DataConfig(source=str(tmp_path / "raw" / "*.csv"), label="y", target_shard_mb=0.02)
    manifest = convert(data, str(tmp_path / "out"))
    assert len(manifest.source.files) == 3
    train = manifest.shards_for("train")
    assert len(train) > 2
    assert [s.path for s in train] == [f"train/part-{i:05d}-of-{len(train):05d}.tfrecord" for i in range(len(train))]
    target = 0.02 * 1024 * 1024
    for shard in train[:-1]:
        assert target <= shard.num_bytes < target + 200  # rolled after the record that reached the target
    root = tmp_path / "out" / "data" / manifest.fingerprint
    for shard in manifest.shards:
        assert digests.local_file_digest(str(root / shard.path), manifest.shard_digest) == shard.digest
        assert os.path.getsize(root / shard.path) == shard.num_bytes
    assert sorted(read_all(manifest)["id"].tolist()) == list(range(3000))


@pytest.mark.parametrize("then_bad_row", [False, True])
def test_a_failed_shard_write_with_a_batch_queued_behind_it_publishes_nothing(tmp_path, monkeypatch, then_bad_row):
    """Encoded batches wait for the writer thread, two at most here (the test sets the limit; conversion's is
    `WRITES_IN_FLIGHT`). The queue never holds more; when a write fails, the one queued behind it finishes before the shards are aborted and the staging directory removed. With
    `then_bad_row` the failure is found only after a bad row two chunks later stopped the conversion, with both
    writes still queued: that error is raised, and both writes are still waited for."""
    import threading
    import time

    rows = make_rows(3000)
    if then_bad_row:
        rows[750]["x"] = "oops"  # chunk 8 of 100 rows: writes 6 (failing) and 7 are queued when it is read
    source = write_csv(tmp_path / "a.csv", rows)
    data = DataConfig(source=source, label="y", read_chunk_rows=100, target_shard_mb=0.01)
    state = {"writes": 0, "queued_max": 0, "after_failure": 0, "failed": False}
    events: list[str] = []
    lock = threading.Lock()
    real_write, real_submit = shard_writer.BackgroundWrites._write, shard_writer.BackgroundWrites.submit

    def slow_write(parts, batch):
        with lock:
            state["writes"] += 1
            number = state["writes"]
            if state["failed"]:
                state["after_failure"] += 1
        time.sleep(0.01)  # a write slower than encoding: the queue fills
        if number == 6:
            state["failed"] = True
            raise OSError(28, "No space left on device")
        real_write(parts, batch)
        if state["failed"]:
            events.append("queued write done")

    def submit(self, *args):
        real_submit(self, *args)
        state["queued_max"] = max(state["queued_max"], len(self._pending))

    real_abort = shard_writer.RollingShards.abort

    def abort(self):
        events.append("abort")
        real_abort(self)

    monkeypatch.setattr(shard_writer, "WRITES_IN_FLIGHT", 2)
    monkeypatch.setattr(shard_writer.BackgroundWrites, "_write", staticmethod(slow_write))
    monkeypatch.setattr(shard_writer.BackgroundWrites, "submit", submit)
    monkeypatch.setattr(shard_writer.RollingShards, "abort", abort)
    expected = (ConversionError, "a.csv line 752") if then_bad_row else (OSError, "No space left")
    with pytest.raises(expected[0], match=expected[1]):
        convert(data, str(tmp_path / "out"))
    assert state["queued_max"] == 2
    assert state["after_failure"] == 1  # the batch queued behind the failed one ran to its end first
    assert events == ["queued write done", "abort", "abort"]
    data_dir = tmp_path / "out" / "data"
    assert not list(data_dir.rglob(MANIFEST_NAME)) and not list(data_dir.rglob("*.tfrecord"))
    assert not any(p.name.startswith(".staging") for p in data_dir.iterdir())

    monkeypatch.setattr(shard_writer.BackgroundWrites, "_write", staticmethod(real_write))
    manifest = convert(DataConfig(source=source, label="y", read_chunk_rows=100, target_shard_mb=0.01,
                                  on_bad_record="skip"), str(tmp_path / "out"))
    assert sorted(read_all(manifest)["id"].tolist()) == [i for i in range(3000) if not (then_bad_row and i == 750)]
