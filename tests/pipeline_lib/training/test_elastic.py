"""Tests for pipeline_lib.training.elastic and the elastic order of pipeline_lib.training.epochs: an attempt's sizes
and learning rate on K workers, its data position, and each record of each epoch used once across resizes."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import tensorflow as tf

from pipeline_lib.checkpoints import manifests
from pipeline_lib.checkpoints.records import CheckpointRecord, DataPosition
from pipeline_lib.checkpoints.store import CheckpointStore
from pipeline_lib.config import parse_config
from pipeline_lib.planning.sharding import AutoShardPolicy, plan_for_train
from pipeline_lib.training import elastic, epochs, input_pipeline
from pipeline_lib.training.errors import TrainingError
from tests.conftest import make_plan


def _train(**train):
    values = {"workers": 3, "per_replica_batch_size": 7, "base_learning_rate": 0.01, "elastic": {"min_workers": 2},
              "shuffle": True, "shuffle_buffer": 64}
    values.update(train)
    return parse_config({"data": {"source": "unused.csv", "label": "label"}, "train": values}).train


@pytest.mark.parametrize(("rule", "factor"), [("linear", 20 / 7), ("sqrt", math.sqrt(20 / 7)), ("none", 1.0)])
def test_attempt_keeps_the_global_batch_or_takes_the_nearest_and_rescales_the_rate(tiny_manifest, rule, factor):
    train = _train(lr_scaling=rule)
    plan = plan_for_train(tiny_manifest, train, 1)
    assert plan.policy == AutoShardPolicy.DATA and plan.global_batch_size == 21
    full = elastic.create_attempt(plan, train, 3, 1)
    # On train.workers the attempt is the run as configured: the rate of its 3 replicas.
    assert (full.global_batch, full.per_replica_batch) == (21, 7)
    assert full.learning_rate == pytest.approx({"linear": 0.03, "sqrt": 0.01 * math.sqrt(3), "none": 0.01}[rule])
    shrunk = elastic.create_attempt(plan, train, 2, 1)
    assert (shrunk.global_batch, shrunk.per_replica_batch, shrunk.configured_global_batch) == (20, 10, 21)
    assert shrunk.learning_rate == pytest.approx(0.01 * factor)
    assert shrunk.epoch_records == 12 * 21  # floor(256 / 21) global batches of the configured size
    assert "global batch 20 (the configured 21 does not split over 2 × 1" in shrunk.describe()


def test_a_parameter_server_attempt_keeps_one_workers_batch_and_the_rate_on_any_worker_count(tiny_manifest):
    # Each parameter-server step is one worker's batch, whichever worker runs it: 7 on 3 workers and on 2.
    train = _train(parameter_servers=1)
    plan = plan_for_train(tiny_manifest, train, 1)
    for workers in (3, 2):
        attempt = elastic.create_attempt(plan, train, workers, 1, parameter_server=True)
        assert (attempt.global_batch, attempt.per_replica_batch, attempt.configured_global_batch) == (7, 7, 7)
        assert (attempt.learning_rate, attempt.learning_rate_replicas) == (pytest.approx(0.01), 1)
        assert attempt.epoch_records == 12 * 21  # the plan's epochs, as a synchronous run of train.workers cuts them
        assert attempt.position_at(5).records == 5 * 7
        assert f"elastic attempt on {workers} worker(s): global batch 7, 7 per replica" in attempt.describe()


def test_attempt_refuses_a_worker_count_or_plan_it_cannot_run(tiny_manifest):
    train = _train()
    plan = plan_for_train(tiny_manifest, train, 1)
    with pytest.raises(TrainingError, match=r"lists 1 training worker.*min_workers \(2\) and train.workers \(3\)"):
        elastic.create_attempt(plan, train, 1, 1)
    with pytest.raises(TrainingError, match=r"lists 4 training worker"):
        elastic.create_attempt(plan, train, 4, 1)
    assert [train.elastic_workers_problem(k) is None for k in (1, 2, 3, 4)] == [False, True, True, False]
    two_worker_plan = make_plan(tiny_manifest, num_workers=2, per_replica_batch_size=7)
    with pytest.raises(TrainingError, match=r"a data plan for 2 worker.*train.workers \(3\)"):
        elastic.create_attempt(two_worker_plan, train, 2, 1)
    with pytest.raises(TrainingError, match=r"1 replica\(s\) per worker but the strategy has 2"):
        elastic.create_attempt(plan, train, 2, 2)


def _stream(manifest, train, attempt, num_steps):
    """The record ids the attempt's workers consume, step by step: each step's slices in worker order."""
    per_worker = [list(epochs.elastic_records(
        manifest, train, epoch_records=attempt.epoch_records, start_record=attempt.start_records,
        global_batch=attempt.global_batch, num_workers=attempt.num_workers, worker=w, num_steps=num_steps,
        with_ids=True).as_numpy_iterator()) for w in range(attempt.num_workers)]
    size = attempt.per_worker_batch
    assert all(len(ids) == num_steps * size for ids in per_worker)
    return [int(i) for step in range(num_steps) for ids in per_worker for i in ids[step * size:(step + 1) * size]]


def test_each_record_of_each_epoch_is_used_once_across_resizes(tiny_manifest):
    """3 workers for 5 steps, 2 workers (global batch 20 for the configured 21) for 30, 3 again for 9: the records
    consumed are the epochs' orders one after the other, each epoch the first 252 records of its own shuffle,
    whatever the worker counts; the same stream one record at a time on one worker."""
    tf.keras.utils.set_random_seed(42)
    train = _train()
    plan = plan_for_train(tiny_manifest, train, 1)
    consumed, step = [], 0
    for workers, steps in ((3, 5), (2, 30), (3, 9)):
        attempt = elastic.create_attempt(plan, train, workers, 1)
        # The resize goes through a checkpoint's manifest position, as a restarted attempt reads it.
        previous = CheckpointRecord(step=step, path="ckpt", data_position=DataPosition(
            records=len(consumed), epoch_records=attempt.epoch_records, num_workers=3, global_batch=21,
            configured_global_batch=21, learning_rate=0.03)) if step else None
        attempt = elastic.resume(attempt, previous, step)
        consumed += _stream(tiny_manifest, train, attempt, steps)
        step += steps
        assert attempt.position_at(step).records == len(consumed)
    epoch_records, num_train = 252, 256
    assert len(consumed) == 5 * 21 + 30 * 20 + 9 * 21 == 894  # epochs 0, 1, 2 whole and 138 records of epoch 3
    epochs_seen = [consumed[e * epoch_records:(e + 1) * epoch_records] for e in range(4)]
    for seen in epochs_seen[:3]:
        assert len(seen) == len(set(seen)) == epoch_records and set(seen) <= set(range(num_train))
    assert len(epochs_seen[3]) == len(set(epochs_seen[3])) == 894 - 3 * epoch_records
    assert epochs_seen[0] != epochs_seen[1]  # each epoch reshuffled
    one_by_one = elastic.ElasticAttempt(num_workers=1, replicas_per_worker=1, configured_global_batch=21,
                                        global_batch=1, per_replica_batch=1, learning_rate=0.01,
                                        learning_rate_replicas=1.0, epoch_records=epoch_records)
    assert consumed == _stream(tiny_manifest, train, one_by_one, len(consumed))


def test_elastic_records_are_the_records_the_ids_name(tiny_manifest):
    """The training stream reads the records themselves in the order the ids give."""
    train = _train()
    common = {"epoch_records": 252, "start_record": 100, "global_batch": 20, "num_workers": 2, "worker": 1,
              "num_steps": 12}
    ids = list(epochs.elastic_records(tiny_manifest, train, with_ids=True, **common).as_numpy_iterator())
    records = list(epochs.elastic_records(tiny_manifest, train, **common).as_numpy_iterator())
    in_file_order = list(input_pipeline.read_records(tiny_manifest, "train").as_numpy_iterator())
    assert records == [in_file_order[i] for i in ids]


@pytest.mark.parametrize(("per_replica", "replicas", "parse_rows"), [(5, 2, 1024), (10, 1, 8)])
def test_the_dataset_fn_parses_the_workers_slices_in_whole_steps(tiny_manifest, monkeypatch, per_replica, replicas,
                                                                  parse_rows):
    """Each worker's input is its slice of the elastic order, parsed in chunks of whole steps, cut to per-replica
    batches: 23 steps of 10 records per worker in one partial chunk of 102 steps, 2 replicas; or, with parse calls
    of at least 8 rows, one step of 10 a chunk, the chunks the batches, over an epoch's end."""
    monkeypatch.setattr(input_pipeline, "PARSE_BATCH_ROWS", parse_rows)
    train = _train(per_replica_batch_size=per_replica, shuffle_buffer=300, steps=26)
    attempt = dataclasses.replace(elastic.create_attempt(plan_for_train(tiny_manifest, train, 1), train, 3, 1),
                                  num_workers=2, replicas_per_worker=replicas, global_batch=2 * replicas * per_replica,
                                  per_replica_batch=per_replica, start_step=3, start_records=40)
    num_steps = 26 - 3
    for worker in (0, 1):
        context = tf.distribute.InputContext(num_input_pipelines=2, input_pipeline_id=worker,
                                             num_replicas_in_sync=2 * replicas)
        batches = epochs.create_elastic_dataset_fn(tiny_manifest, train, attempt, 3 + num_steps, True)(context)
        records = epochs.elastic_records(tiny_manifest, train, epoch_records=attempt.epoch_records, start_record=40,
                                         global_batch=attempt.global_batch, num_workers=2, worker=worker,
                                         num_steps=num_steps)
        expected = input_pipeline.batches_from_records(records, tiny_manifest, per_replica, drop_remainder=True,
                                                       is_classification=True)
        got, want = list(batches.as_numpy_iterator()), list(expected.as_numpy_iterator())
        assert len(got) == len(want) == num_steps * replicas
        for (inputs, labels), (want_inputs, want_labels) in zip(got, want):
            np.testing.assert_array_equal(labels, want_labels)
            for key in want_inputs:
                np.testing.assert_array_equal(inputs[key], want_inputs[key])


def test_resume_reads_the_position_or_falls_back_to_steps(tiny_manifest):
    train = _train()
    attempt = elastic.create_attempt(plan_for_train(tiny_manifest, train, 1), train, 2, 1)
    assert elastic.resume(attempt, None, 0).start_records == 0
    saved = CheckpointRecord(step=7, path="ckpt-7", data_position=attempt.position_at(7))
    assert elastic.resume(attempt, saved, 7).start_records == 7 * 20
    old = CheckpointRecord(step=7, path="ckpt-7")  # no position: saved by an older tfdag
    assert elastic.resume(attempt, old, 7).start_records == 7 * 21
    other = saved.model_copy(update={"data_position": saved.data_position.model_copy(update={"epoch_records": 240})})
    with pytest.raises(TrainingError, match=r"epochs of 240 records, but this plan cuts them to 252"):
        elastic.resume(attempt, other, 7)


def test_a_checkpoint_manifest_keeps_the_data_position(tmp_path):
    """The store writes the position in the manifest and every reader of checkpoints gets it back; a checkpoint
    saved without one reads as None."""
    import keras

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    store = CheckpointStore(str(tmp_path), tf.train.Checkpoint(model=model))
    position = DataPosition(records=740, epoch_records=252, num_workers=2, global_batch=20,
                            configured_global_batch=21, learning_rate=0.0285)
    store.save(5)
    saved = store.save(37, data_position=position)
    assert saved.data_position == position
    assert manifests.latest_valid(str(tmp_path)).data_position == position
    assert [r.data_position for r in manifests.list_checkpoints(str(tmp_path))] == [None, position]
    assert np.isclose(manifests.read_manifest(saved.path)["data_position"]["learning_rate"], 0.0285)
