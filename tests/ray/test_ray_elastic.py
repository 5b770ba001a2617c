"""Elastic training on the real Ray test cluster: a 3-worker MultiWorkerMirrored run on three nodes of its own loses
one node's raylet (SIGKILL) with no spare, continues on 2 workers, and takes a node started afterwards back at an
agreed checkpoint; every example of every epoch once, by the ids the workers record."""

from __future__ import annotations

import glob
import os
import signal
import threading
import time
import uuid

import pytest

from pipeline_lib.launch.ray_launcher import launch_on_ray
from pipeline_lib.testing.example_ids import EXAMPLE_IDS_ENV, read_record, record_path
from pipeline_lib.testing.faults import FAULT_ENV
from tests.pipeline_lib.launch_support import (
    LogCapture,
    make_config,
    make_spec,
    plan_for,
    write_digits_dataset,
)
from tests.ray.conftest import RAY_IP

STEPS = 300
DIGITS_MODEL = {"factory": "mlp", "params": {"hidden_units": [64]}}


@pytest.mark.slow
def test_a_lost_node_without_a_spare_continues_on_two_workers_and_a_new_node_is_taken_back(ray_cluster, tmp_path):
    group = f"elastic_{uuid.uuid4().hex[:8]}"
    with ray_cluster.nodes_of_their_own(group, 3) as added:  # the run's tasks fit only there: none spare
        _lose_a_node_and_take_one_back(ray_cluster, group, added, tmp_path)


def _lose_a_node_and_take_one_back(ray_cluster, group: str, added: list[str], tmp_path) -> None:
    manifest = write_digits_dataset(str(tmp_path / "digits"), example_ids=True)
    ray = {"address": ray_cluster.address, "node_ip_address": RAY_IP, "resources_per_worker": {"CPU": 1, group: 1},
           "placement_timeout_s": 90}
    config = make_config(str(tmp_path / "out"), label="target", model=DIGITS_MODEL, launcher="ray", ray=ray,
                         strategy="multi_worker_mirrored", workers=3, per_replica_batch_size=25, steps=STEPS,
                         base_learning_rate=0.01, lr_scaling="none", shuffle=True, shuffle_buffer=2000,
                         checkpoint_every_steps=20, log_every_steps=20, hang_timeout_s=60.0, max_restarts=2,
                         elastic={"min_workers": 2, "wait_s": 2.0}, early_stopping={"enabled": False})
    run_dir, ids_dir = str(tmp_path / "run"), str(tmp_path / "ids")
    spec = make_spec(config, manifest, plan_for(manifest, config, steps=STEPS), run_dir)
    logs, resized, outcome = LogCapture(), [], {}

    def run() -> None:
        try:
            # The chief pauses 6 s after step 150, once a run: on 2 workers unless the node was taken back sooner,
            # so the 2-worker group cannot finish before the returning node is seen.
            outcome["launch"] = launch_on_ray(spec, config, log_fn=logs, on_resize=resized.append,
                                              env={EXAMPLE_IDS_ENV: ids_dir,
                                                   FAULT_ENV: "sleep:worker=0:step=150:seconds=6"})
        except BaseException as error:  # noqa: BLE001 - re-raised in the test thread
            outcome["error"] = error

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 600
    while not glob.glob(os.path.join(run_dir, "checkpoints", "ckpt-40*")):  # training is under way on 3
        assert time.monotonic() < deadline and thread.is_alive(), outcome
        time.sleep(0.5)
    lost = next(a.node_id for a in ray_cluster.alive_actors() if a.name.endswith("worker 2"))
    os.kill(ray_cluster.raylet_pid(lost), signal.SIGKILL)
    ray_cluster.forget_node(lost)
    # Capacity returns once the supervisor has settled on 2 workers, while their group starts: a node takes seconds
    # to join, and the 2-worker group must still be stepping when the supervisor next asks for more (every 3 s).
    while logs.first_time("[supervisor] resizing the group from 3 to 2 workers") is None:
        assert time.monotonic() < deadline and thread.is_alive(), outcome
        time.sleep(0.2)
    added.append(ray_cluster.add_node(f"{group}_3", {group: 1}))
    thread.join(timeout=max(deadline - time.monotonic(), 1))
    assert not thread.is_alive(), "the launch did not end within 600 s"
    if "error" in outcome:
        raise outcome["error"]

    launched = outcome["launch"]
    result = launched.result
    assert (result.final_step, result.total_steps, result.num_workers) == (STEPS, STEPS, 3)
    assert result.checkpoints[-1].metrics["eval_accuracy"] >= 0.95, result.checkpoints[-1].metrics
    shrink, grow = result.resizes
    assert (shrink.from_workers, shrink.to_workers, grow.from_workers, grow.to_workers) == (3, 2, 2, 3)
    assert shrink.step >= 40 and "worker 2" in shrink.reason and grow.step > shrink.step
    assert resized == [shrink, grow]
    assert f"[supervisor] resize 2: 2 → 3 workers at step {grow.step}" in logs.text

    consumed = []
    for workers, start, steps in ((3, 0, shrink.step), (2, shrink.step, grow.step - shrink.step),
                                  (3, grow.step, STEPS - grow.step)):
        fed = [read_record(record_path(ids_dir, w, workers, start)) for w in range(workers)]
        assert all(len(batches) >= steps for batches in fed)
        consumed += [i for step in range(steps) for batches in fed for i in batches[step]]
    epoch_records = result.steps_per_epoch * 75
    epochs = [consumed[start:start + epoch_records] for start in range(0, len(consumed), epoch_records)]
    assert all(len(set(epoch)) == len(epoch) for epoch in epochs)  # no example twice in an epoch
    assert all(len(epoch) == epoch_records for epoch in epochs[:-1])  # and none left out of a whole one
