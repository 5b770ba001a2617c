"""An elastic run resumed on fewer workers through the local launcher: real worker processes, a real agreed stop and
checkpoint, the same WorkerSpec with a TF_CONFIG of 2 workers for the next attempt; every example of every epoch
once, by the example ids the workers record."""

from __future__ import annotations

import os

import pytest

from pipeline_lib.checkpoints import manifests
from pipeline_lib.cluster.info import ClusterInfo
from pipeline_lib.launch.local import LocalGroup, launch
from pipeline_lib.launch.processes import TaskSpec
from pipeline_lib.launch.spec import EXAMPLE_IDS_ENV, FAULT_ENV
from pipeline_lib.planning.sharding import plan_for_train
from pipeline_lib.testing.example_ids import read_record, record_path
from pipeline_lib.training import epochs
from tests.pipeline_lib.launch_support import (
    LogCapture,
    assert_no_orphans,
    make_config,
    make_spec,
    write_digits_dataset,
)


@pytest.fixture(autouse=True)
def no_orphans():
    yield
    assert_no_orphans()


class _ResizingGroup(LocalGroup):
    """Local worker processes, attempt n on `sizes[n]` of the train.workers addresses: what the elastic launcher
    will hand a resized attempt (the same spec, a TF_CONFIG listing K workers)."""

    def __init__(self, spec, config, env, sizes):
        super().__init__(spec, config, env)
        self.sizes = list(sizes)

    def plan_attempt(self) -> list[TaskSpec]:
        addresses = super().plan_attempt()[0].cluster.cluster["worker"][: self.sizes.pop(0)]
        return [TaskSpec(ClusterInfo(task_type="worker", task_index=i, cluster={"worker": addresses}),
                         is_trainer=True) for i in range(len(addresses))]


def _saved_rate(prefix: str) -> float:
    import tensorflow as tf

    reader = tf.train.load_checkpoint(prefix)
    return float(reader.get_tensor("optimizer/_learning_rate/.ATTRIBUTES/VARIABLE_VALUE"))


@pytest.mark.slow
def test_a_run_stopped_on_3_workers_resumes_on_2_with_every_example_of_every_epoch_once(tmp_path):
    """Digits, 1437 train rows, global batch 75 (3 workers × 25): 19 steps and 1425 records per epoch. Worker 1 is
    preempted after step 12 (mid-epoch; the group agrees on a checkpoint there); the restarted attempt has 2
    workers: 75 does not split over 2, so the global batch is 74 (37 per replica; 74 and 76 are as near, the
    smaller wins) and the rate follows, linearly. It trains on to step 30, exactly."""
    import tensorflow as tf

    manifest = write_digits_dataset(str(tmp_path / "digits"), example_ids=True)
    config = make_config(str(tmp_path), label="target", workers=3, per_replica_batch_size=25, steps=30,
                         shuffle=True, shuffle_buffer=2000, base_learning_rate=0.002, max_restarts=1,
                         elastic={"min_workers": 2})
    plan = plan_for_train(manifest, config.train, 1)
    assert (plan.global_batch_size, plan.steps_per_epoch, plan.total_steps) == (75, 19, 30)
    run_dir, ids_dir = str(tmp_path / "run"), str(tmp_path / "ids")
    spec = make_spec(config, manifest, plan, run_dir)
    env = {FAULT_ENV: "term:worker=1:step=12", EXAMPLE_IDS_ENV: ids_dir}
    logs = LogCapture()
    outcome = launch(spec, config, log_fn=logs, group=_ResizingGroup(spec, config, env, sizes=(3, 2)))

    result = outcome.result
    assert [r.resumed_step for r in outcome.restarts] == [12] and outcome.num_attempts == 2
    assert (result.start_step, result.final_step, result.total_steps) == (12, 30, 30)
    assert (result.num_workers, result.global_batch_size, result.per_replica_batch_size) == (2, 74, 37)
    assert result.scaled_learning_rate == pytest.approx(0.002 * 74 / 25)
    assert "elastic attempt on 2 worker(s): global batch 74 (the configured 75 does not split" in logs.text
    checkpoints = os.path.join(run_dir, "checkpoints")
    positions = {r.step: r.data_position for r in manifests.list_checkpoints(checkpoints)}
    assert (positions[12].records, positions[12].num_workers, positions[12].global_batch) == (12 * 75, 3, 75)
    assert positions[12].learning_rate == pytest.approx(0.002 * 3)
    last = positions[30]
    assert (last.records, last.num_workers, last.global_batch, last.configured_global_batch) == (
        12 * 75 + 18 * 74, 2, 74, 75)
    assert last.learning_rate == pytest.approx(0.002 * 74 / 25)
    # The optimizer trained at it: its rate variable, restored at 0.006 from step 12, was set to the attempt's.
    assert [_saved_rate(os.path.join(checkpoints, f"ckpt-{step}")) for step in (12, 30)] == pytest.approx(
        [0.002 * 3, 0.002 * 74 / 25])

    # What the workers fed, step by step: each step's slices in worker order; the batches read ahead of the stop
    # (the first attempt ran 12 steps, the second 18) were never trained.
    consumed = []
    for workers, start, steps in ((3, 0, 12), (2, 12, 18)):
        fed = [read_record(record_path(ids_dir, w, workers, start)) for w in range(workers)]
        assert all(len(batches) >= steps for batches in fed)
        consumed += [i for step in range(steps) for batches in fed for i in batches[step]]
    assert len(consumed) == 12 * 75 + 18 * 74 == 2232  # epoch 0 whole, 807 records of epoch 1
    epoch_0, epoch_1 = consumed[:1425], consumed[1425:]
    assert len(set(epoch_0)) == 1425 and len(set(epoch_1)) == 807 and set(consumed) <= set(range(1437))
    # And it is the order the elastic stream defines, whatever the split: the same ids one by one on one worker.
    tf.keras.utils.set_random_seed(config.train.seed)  # as every worker seeds
    expected = epochs.elastic_records(manifest, config.train, epoch_records=1425, start_record=0, global_batch=1,
                                      num_workers=1, worker=0, num_steps=2232, with_ids=True)
    assert consumed == [int(i) for i in expected.as_numpy_iterator()]
