"""Tests for pipeline_lib.planning.sharding: FILE vs DATA autosharding, balance, equal steps, forced policies, errors."""

from __future__ import annotations

import random

import pytest

from pipeline_lib.config import AutoShard
from pipeline_lib.data.manifest import (
    DType,
    FeatureSpec,
    Manifest,
    Schema,
    ShardInfo,
    SourceFingerprint,
)
from pipeline_lib.planning.sharding import (
    AutoShardPolicy,
    PlanError,
    plan_shards,
    plan_to_markdown,
)


def manifest_of(counts: list[int], eval_counts: tuple[int, ...] = (10,)) -> Manifest:
    shards = [ShardInfo(split="train", path=f"train/part-{i:05d}-of-{len(counts):05d}.tfrecord", num_records=n,
                        num_bytes=n * 10, sha256=f"{i:064d}") for i, n in enumerate(counts)]
    shards += [ShardInfo(split="eval", path=f"eval/part-{i:05d}.tfrecord", num_records=n, num_bytes=n,
                         sha256="e" * 64) for i, n in enumerate(eval_counts)]
    schema = Schema(features=(FeatureSpec(name="x", dtype=DType.FLOAT32, shape=(2,)),),
                    label=FeatureSpec(name="y", dtype=DType.INT64), num_classes=2)
    return Manifest(fingerprint="f", dataset_uri="/data/f", feature_schema=schema, shards=tuple(shards),
                    source=SourceFingerprint(files=(), sha256="0" * 64))


def plan(counts, num_workers=2, replicas=1, batch=4, epochs=2, **kwargs):
    return plan_shards(manifest_of(counts), num_workers=num_workers, replicas_per_worker=replicas,
                       per_replica_batch_size=batch, epochs=epochs, **kwargs)


def test_file_autosharding_balances_files_greedily_by_record_count():
    counts = [100, 90, 80, 70, 60, 50, 40, 30]  # 520 records over 4 workers: 130 each is reachable
    result = plan(counts, num_workers=4, batch=8)
    assert result.policy == AutoShardPolicy.FILE
    files = [f for a in result.assignments for f in a.files]
    assert sorted(files) == sorted(s.path for s in manifest_of(counts).shards_for("train"))  # each file once
    by_path = {s.path: s.num_records for s in manifest_of(counts).shards}
    for assignment in result.assignments:
        assert assignment.num_records == sum(by_path[f] for f in assignment.files)
    loads = [a.num_records for a in result.assignments]
    assert loads == [130, 130, 130, 130]
    assert result.imbalance_ratio == pytest.approx(1.0)
    assert result.warnings == ()


def test_steps_per_epoch_is_the_least_loaded_workers_count_on_every_worker():
    result = plan([50, 40, 30, 20], num_workers=2, replicas=2, batch=3, epochs=3)
    loads = sorted(a.num_records for a in result.assignments)
    assert loads == [70, 70]
    assert result.global_batch_size == 3 * 2 * 2
    assert result.steps_per_epoch == 70 // (3 * 2)
    assert result.total_steps == 3 * result.steps_per_epoch
    uneven = plan([61, 50, 11], num_workers=2, batch=5, policy=AutoShard.FILE)
    loads = {a.worker_index: a.num_records for a in uneven.assignments}
    assert sorted(loads.values()) == [61, 61]
    assert uneven.steps_per_epoch == 61 // 5


def test_fewer_files_than_workers_falls_back_to_data_with_a_warning():
    result = plan([100, 100], num_workers=4, batch=5)
    assert result.policy == AutoShardPolicy.DATA
    for assignment in result.assignments:
        assert assignment.files == ("train/part-00000-of-00002.tfrecord", "train/part-00001-of-00002.tfrecord")
    assert [a.num_records for a in result.assignments] == [50, 50, 50, 50]
    assert result.steps_per_epoch == 200 // (5 * 4)
    assert any("2 train file(s) for 4 workers" in w and "DATA" in w for w in result.warnings)


def test_data_slices_count_the_records_each_worker_keeps():
    result = plan([10, 11], num_workers=3, batch=1, policy=AutoShard.DATA)
    assert [a.num_records for a in result.assignments] == [7, 7, 7]
    result = plan([11], num_workers=3, batch=1, policy="data")
    assert [a.num_records for a in result.assignments] == [4, 4, 3]
    assert result.steps_per_epoch == 11 // 3


def test_imbalanced_files_fall_back_to_data_naming_the_overloaded_worker():
    result = plan([1000, 10, 10, 10], num_workers=2, batch=4)
    assert result.policy == AutoShardPolicy.DATA
    assert len(result.warnings) == 1
    assert "worker 0 would hold 1.94× the mean records" in result.warnings[0]
    assert "data.target_shard_mb" in result.warnings[0]


def test_forced_file_keeps_file_and_warns_about_the_overloaded_worker():
    result = plan([10, 10, 1000, 10], num_workers=2, batch=4, policy=AutoShard.FILE)
    assert result.policy == AutoShardPolicy.FILE
    heavy = next(a for a in result.assignments if "train/part-00002-of-00004.tfrecord" in a.files)
    assert heavy.files == ("train/part-00002-of-00004.tfrecord",)
    assert result.steps_per_epoch == 30 // 4  # the light worker's count, on both
    assert result.imbalance_ratio == pytest.approx(1000 / 515)
    warning = result.warnings[0]
    assert f"worker {heavy.worker_index} holds 1.94× the mean records (1000 of 1030)" in warning
    assert "uses 28 of them each epoch" in warning
    assert result.policy == plan([10, 10, 1000, 10], policy=AutoShardPolicy.FILE).policy


def test_forced_data_with_enough_balanced_files():
    result = plan([10] * 8, num_workers=2, policy=AutoShard.DATA)
    assert result.policy == AutoShardPolicy.DATA
    assert all(len(a.files) == 8 for a in result.assignments)


def test_forced_file_with_fewer_files_than_workers_names_the_counts_and_the_fix():
    with pytest.raises(PlanError) as error:
        plan([100, 100, 100], num_workers=4, policy=AutoShard.FILE)
    message = str(error.value)
    assert "has 3 file(s) for 4 workers" in message
    assert "/data/f" in message
    assert "train.autoshard: data" in message and "data.target_shard_mb" in message


def test_zero_steps_names_records_global_batch_and_fix():
    with pytest.raises(PlanError) as error:
        plan([10, 10], num_workers=2, replicas=2, batch=8)
    message = str(error.value)
    assert "has 20 records, fewer than one global batch of 32 (8 per replica × 2 replica(s) × 2 worker(s))" in message
    assert "0 steps per epoch" in message and "lower train.per_replica_batch_size" in message


def test_zero_steps_under_forced_file_names_the_light_worker():
    with pytest.raises(PlanError, match=r"worker \d gets 3 train records under FILE autosharding, fewer than its "
                                        r"per-worker batch of 4"):
        plan([40, 3], num_workers=2, batch=4, policy=AutoShard.FILE)


def test_auto_prefers_data_when_file_would_give_a_worker_no_step():
    result = plan([11, 9], num_workers=2, batch=10)  # FILE: 9 // 10 = 0 steps; DATA: 20 // 20 = 1
    assert result.policy == AutoShardPolicy.DATA
    assert result.steps_per_epoch == 1
    assert "worker 1 would get 9 records under FILE autosharding" in result.warnings[0]


def test_steps_override_epochs():
    result = plan([40, 40], num_workers=2, batch=4, epochs=9, steps=25)
    assert result.steps_per_epoch == 10
    assert result.total_steps == 25
    assert result.epochs == 3  # ceil(25 / 10) passes over the data


@pytest.mark.parametrize("kwargs, name", [
    ({"num_workers": 0}, "num_workers"),
    ({"replicas": 0}, "replicas_per_worker"),
    ({"batch": 0}, "per_replica_batch_size"),
    ({"epochs": 0}, "epochs"),
    ({"steps": 0}, "steps"),
])
def test_counts_below_one_are_rejected(kwargs, name):
    with pytest.raises(PlanError, match=rf"{name} \(0\) must be an integer ≥ 1"):
        plan([10, 10], **kwargs)


def test_unknown_split_and_policy():
    with pytest.raises(PlanError, match=r"no 'test' shards \(splits: \['eval', 'train'\]\)"):
        plan([10], split="test")
    with pytest.raises(PlanError, match=r"train.autoshard \('files'\) is not a shard policy"):
        plan([10], policy="files")


def test_eval_split_can_be_planned():
    result = plan_shards(manifest_of([10], eval_counts=(8, 8)), num_workers=2, replicas_per_worker=1,
                         per_replica_batch_size=2, epochs=1, split="eval")
    assert result.policy == AutoShardPolicy.FILE
    assert result.steps_per_epoch == 4


def test_many_files_over_many_workers_balance():
    rng = random.Random(0)
    counts = [rng.randint(800, 1200) for _ in range(100_000)]
    result = plan(counts, num_workers=64, batch=32, epochs=1)
    assert result.policy == AutoShardPolicy.FILE
    assert len(result.assignments) == 64
    assert sum(len(a.files) for a in result.assignments) == 100_000
    assert result.imbalance_ratio < 1.001
    assert result.steps_per_epoch == min(a.num_records for a in result.assignments) // 32


def test_markdown():
    result = plan([100, 90, 80, 70, 60], num_workers=2, batch=4)
    text = plan_to_markdown(result, max_files=2)
    assert plan_to_markdown(result) == result.to_markdown()
    assert "| policy | file |" in text
    assert f"| steps per epoch (every worker) | {result.steps_per_epoch} |" in text
    assert "… and 1 more" in text
    for assignment in result.assignments:
        assert f"| {assignment.worker_index} | {len(assignment.files)} | {assignment.num_records} |" in text
    warned = plan([1000, 10, 10, 10], num_workers=2)
    assert "## Warnings" in plan_to_markdown(warned)


def test_plan_for_train_takes_the_sizes_from_the_train_section():
    from pipeline_lib.config import TrainConfig
    from pipeline_lib.planning.sharding import plan_for_train

    manifest = manifest_of([100] * 4)
    train = TrainConfig(workers=2, per_replica_batch_size=10, epochs=3, steps=None, autoshard="data")
    plan = plan_for_train(manifest, train, replicas_per_worker=2)
    assert (plan.num_workers, plan.global_batch_size, plan.epochs, plan.policy.value) == (2, 40, 3, "data")
    assert plan_for_train(manifest, train, 1, num_workers=4).num_workers == 4
