"""Per-worker staging of TFRecord shards from fsspec storage (memory://) into a verified local cache."""

from __future__ import annotations

import os
import uuid

import blake3
import fsspec
import pytest

from pipeline_lib.cluster.info import ClusterInfo
from pipeline_lib.core import digests, retry, storage
from pipeline_lib.core.digests import DigestAlgorithm
from pipeline_lib.planning.sharding import AutoShardPolicy
from pipeline_lib.training import input_pipeline, staging
from tests.conftest import make_plan, write_dataset


def _upload(manifest, uri: str):
    """Copy a local dataset to a memory:// URI and return its manifest there."""
    fs = fsspec.filesystem("memory")
    root = uri.removeprefix("memory://")
    for shard in manifest.shards:
        fs.put_file(os.path.join(manifest.dataset_uri, shard.path), f"{root}/{shard.path}")
    return manifest.model_copy(update={"dataset_uri": uri})


@pytest.fixture
def remote(tmp_path):
    local = write_dataset(str(tmp_path / "src"), num_train=96, num_eval=32, num_train_shards=4)
    uri = f"memory://tfdag-test-{uuid.uuid4().hex[:8]}/data/test"
    yield _upload(local, uri)
    fsspec.filesystem("memory").rm(uri.removeprefix("memory://").split("/data")[0], recursive=True)


def _worker(index: int, num_workers: int) -> ClusterInfo:
    addresses = tuple(f"127.0.0.1:{2000 + i}" for i in range(num_workers))
    return ClusterInfo(task_type="worker", task_index=index, cluster={"worker": addresses})


def test_local_dataset_is_used_in_place(tiny_manifest, tmp_path):
    staged = staging.stage_for_worker(tiny_manifest, make_plan(tiny_manifest), ClusterInfo(),
                                      cache_dir=str(tmp_path / "cache"))
    assert staged is tiny_manifest
    assert not (tmp_path / "cache").exists()


def test_file_policy_stages_only_the_workers_files(remote, tmp_path):
    plan = make_plan(remote, num_workers=2, per_replica_batch_size=8, policy=AutoShardPolicy.FILE)
    cache = str(tmp_path / "cache")
    staged = staging.stage_for_worker(remote, plan, _worker(1, 2), cache_dir=cache)
    local_dir = staged.dataset_uri
    assert local_dir.startswith(cache) and storage.is_local(local_dir)
    present = sorted(os.path.relpath(os.path.join(r, f), local_dir).replace(os.sep, "/")
                     for r, _d, files in os.walk(local_dir) for f in files if not f.endswith(".lock"))
    # Worker 1 is not the chief: its own train files, no eval split.
    assert present == sorted(plan.files_for(1))
    assert staged.content_hash() == remote.content_hash()
    # tf.data reads the staged files: every record of the worker's shards.
    dataset = input_pipeline.create_dataset(staged, "train", 4, files=plan.files_for(1))
    assert sum(int(labels.shape[0]) for _inputs, labels in dataset) == plan.assignments[1].num_records


def test_data_policy_stages_every_train_file_and_the_chief_gets_eval(remote, tmp_path):
    plan = make_plan(remote, num_workers=2, per_replica_batch_size=8, policy=AutoShardPolicy.DATA)
    staged = staging.stage_for_worker(remote, plan, _worker(0, 2), cache_dir=str(tmp_path / "cache"))
    for shard in remote.shards:
        assert os.path.isfile(os.path.join(staged.dataset_uri, shard.path)), shard.path
    eval_records = sum(int(y.shape[0]) for _x, y in input_pipeline.create_dataset(staged, "eval", 16))
    assert eval_records == remote.num_records("eval")


def test_cached_files_are_reused_after_verification(remote, tmp_path):
    cache = str(tmp_path / "cache")
    files = [s.path for s in remote.shards_for("train")]
    first = staging.stage_files(remote, files, cache_dir=cache)
    assert sorted(first.downloaded) == sorted(files) and first.reused == ()
    assert first.num_bytes_downloaded == sum(s.num_bytes for s in remote.shards_for("train"))
    second = staging.stage_files(remote, files, cache_dir=cache)
    assert second.downloaded == () and sorted(second.reused) == sorted(files)


def test_a_corrupted_cached_file_is_downloaded_again(remote, tmp_path):
    cache = str(tmp_path / "cache")
    shard = remote.shards_for("train")[0]
    report = staging.stage_files(remote, [shard.path], cache_dir=cache)
    path = os.path.join(report.local_dir, shard.path)
    with open(path, "r+b") as handle:
        handle.seek(10)
        handle.write(b"\xff\xff\xff")
    again = staging.stage_files(remote, [shard.path], cache_dir=cache)
    assert again.downloaded == (shard.path,)
    assert digests.local_file_digest(path) == shard.digest  # write_dataset's manifests name no algorithm: sha256


def test_a_remote_shard_that_does_not_match_the_manifest_is_refused(remote, tmp_path, monkeypatch):
    # The object is not the one the manifest records: permanent under the storage retry policy.
    monkeypatch.setattr(retry.time, "sleep", lambda s: pytest.fail("a checksum mismatch was retried"))
    shard = remote.shards_for("train")[0]
    fsspec.filesystem("memory").pipe_file(f"{remote.dataset_uri.removeprefix('memory://')}/{shard.path}",
                                          b"not a tfrecord")
    with pytest.raises(staging.StagingError) as caught:
        staging.stage_files(remote, [shard.path], cache_dir=str(tmp_path / "cache"))
    message = str(caught.value)
    assert storage.join(remote.dataset_uri, shard.path) in message and "sha256" in message
    local = os.path.join(staging.dataset_cache_dir(remote, str(tmp_path / "cache")), shard.path)
    # Nothing under the shard's real name, and no temporary file left behind.
    assert not os.path.exists(local)
    assert [n for n in os.listdir(os.path.dirname(local)) if ".tmp-" in n] == []


def test_a_missing_remote_shard_names_its_uri(remote, tmp_path):
    shard = remote.shards_for("train")[1]
    fsspec.filesystem("memory").rm_file(f"{remote.dataset_uri.removeprefix('memory://')}/{shard.path}")
    with pytest.raises(staging.StagingError, match="does not exist") as caught:
        staging.stage_files(remote, [shard.path], cache_dir=str(tmp_path / "cache"))
    assert storage.join(remote.dataset_uri, shard.path) in str(caught.value)


def test_transient_errors_are_retried(remote, tmp_path, monkeypatch):
    monkeypatch.setattr(retry, "STORAGE_RETRY", retry.RetryPolicy(backoff_s=0.0))
    real_open = fsspec.implementations.memory.MemoryFileSystem._open
    calls = {"n": 0}

    def flaky_open(self, path, mode="rb", **kwargs):
        calls["n"] += 1
        if calls["n"] <= 2:
            raise ConnectionError("simulated outage")
        return real_open(self, path, mode, **kwargs)

    monkeypatch.setattr(fsspec.implementations.memory.MemoryFileSystem, "_open", flaky_open)
    shard = remote.shards_for("train")[0]
    report = staging.stage_files(remote, [shard.path], cache_dir=str(tmp_path / "cache"))
    assert report.downloaded == (shard.path,) and calls["n"] == 3


def test_unknown_files_and_workers_are_rejected(remote, tmp_path):
    with pytest.raises(staging.StagingError, match="not shards of the manifest"):
        staging.stage_files(remote, ["train/nope.tfrecord"], cache_dir=str(tmp_path))
    plan = make_plan(remote, num_workers=2, per_replica_batch_size=8, policy=AutoShardPolicy.FILE)
    with pytest.raises(staging.StagingError, match="worker index 5"):
        staging.files_for_worker(remote, plan, 5)


def test_stage_split_gives_a_local_eval_manifest(remote, tmp_path):
    staged = staging.stage_split(remote, "eval", cache_dir=str(tmp_path / "cache"))
    assert storage.is_local(staged.dataset_uri)
    assert all(os.path.isfile(os.path.join(staged.dataset_uri, s.path)) for s in remote.shards_for("eval"))
    assert not any(os.path.exists(os.path.join(staged.dataset_uri, s.path)) for s in remote.shards_for("train"))


def test_statistics_json_is_staged_with_the_shards(remote, tmp_path):
    from pipeline_lib.data.statistics import STATISTICS_NAME, load_statistics

    payload = b'{"label": "label", "splits": {}}'
    import hashlib

    fsspec.filesystem("memory").pipe_file(f"{remote.dataset_uri.removeprefix('memory://')}/{STATISTICS_NAME}", payload)
    with_statistics = remote.model_copy(update={"statistics_sha256": hashlib.sha256(payload).hexdigest()})
    staged = staging.stage_split(with_statistics, "eval", cache_dir=str(tmp_path / "cache"))
    assert load_statistics(staged).label == "label"  # read from the local copy, checked against the manifest


def test_a_blake3_manifest_verifies_its_shards_and_names_blake3_on_a_mismatch(remote, tmp_path):
    # What conversion writes now: BLAKE3 digests, named by the manifest (write_dataset's manifests are sha256).
    fs, root = fsspec.filesystem("memory"), remote.dataset_uri.removeprefix("memory://")
    shards = tuple(s.model_copy(update={"digest": blake3.blake3(fs.cat_file(f"{root}/{s.path}")).hexdigest()})
                   for s in remote.shards)
    manifest = remote.model_copy(update={"shards": shards, "shard_digest": DigestAlgorithm.BLAKE3})
    files = [s.path for s in manifest.shards_for("train")]
    cache = str(tmp_path / "cache")
    assert sorted(staging.stage_files(manifest, files, cache_dir=cache).downloaded) == sorted(files)
    assert sorted(staging.stage_files(manifest, files, cache_dir=cache).reused) == sorted(files)
    # The sha256 the old manifest recorded is not accepted as a BLAKE3 digest: the algorithm really is used.
    mixed = manifest.model_copy(update={"shards": remote.shards})
    with pytest.raises(staging.StagingError, match="blake3"):
        staging.stage_files(mixed, files[:1], cache_dir=str(tmp_path / "other"))
