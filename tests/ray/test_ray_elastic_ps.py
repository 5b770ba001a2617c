"""Elastic parameter-server training on the real Ray test cluster: a run of a chief, 1 ps and 3 workers, each task on
a node of its own (none spare), loses a worker's node (its raylet SIGKILLed) and continues on 2 workers with its ps
kept; every example of every epoch once, by the ids the coordinator records. Growing back is tested locally for PS
(tests/pipeline_lib/launch/test_elastic.py) and on Ray for MWMS (test_ray_elastic.py)."""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid

import pytest

from pipeline_lib.checkpoints import manifests
from pipeline_lib.launch.ray_launcher import launch_on_ray
from pipeline_lib.planning.sharding import plan_for_train
from pipeline_lib.testing.example_ids import EXAMPLE_IDS_ENV
from pipeline_lib.testing.faults import FAULT_ENV
from tests.pipeline_lib.launch_support import (
    LogCapture,
    assert_coordinator_fed_each_example_once,
    make_config,
    make_spec,
    write_digits_dataset,
)
from tests.ray.conftest import RAY_IP

STEPS = 15
NUM_TASKS = 5  # the chief, 1 ps, 3 workers


# Five nodes of its own and a lost one: the longest Ray run. What it combines is checked in the default run by its
# parts: PS shrinking and growing back locally (test_elastic.py's parameter-server case) and a lost Ray node's
# shrink and regrowth for MWMS (test_ray_elastic.py). TFDAG_RAY_FAULT_MATRIX=full runs it too.
@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("TFDAG_RAY_FAULT_MATRIX") != "full",
                    reason="PS elasticity is checked locally (test_elastic.py) and a lost Ray node with MWMS "
                           "(test_ray_elastic.py) in the default run: TFDAG_RAY_FAULT_MATRIX=full runs this too")
def test_parameter_server_on_ray_loses_a_worker_node_and_continues_on_two_workers_with_its_ps(ray_cluster, tmp_path):
    group = f"elastic_ps_{uuid.uuid4().hex[:8]}"
    with ray_cluster.nodes_of_their_own(group, NUM_TASKS):  # one task each, none spare
        _lose_a_worker_node(ray_cluster, group, tmp_path)


def _lose_a_worker_node(ray_cluster, group: str, tmp_path) -> None:
    """Steps of 100 examples (one worker's batch; the plan's global batch 300 cuts each epoch to 1200 records: 12
    steps). The chief sleeps after step 6, so the node is lost while the attempt is past ckpt-5 and short of
    ckpt-10: the group restarts from ckpt-5, whatever the machine's speed."""
    manifest = write_digits_dataset(str(tmp_path / "digits"), example_ids=True)
    ray = {"address": ray_cluster.address, "node_ip_address": RAY_IP, "resources_per_worker": {"CPU": 1, group: 1},
           "placement_timeout_s": 90}
    config = make_config(str(tmp_path / "out"), label="target", launcher="ray", ray=ray, strategy="parameter_server",
                         workers=3, parameter_servers=1, per_replica_batch_size=100, steps=STEPS,
                         checkpoint_every_steps=5, log_every_steps=1, shuffle=True, shuffle_buffer=2000,
                         base_learning_rate=0.01, hang_timeout_s=60.0, max_restarts=1,
                         elastic={"min_workers": 2, "wait_s": 1.0}, early_stopping={"enabled": False})
    plan = plan_for_train(manifest, config.train, 1)
    assert (plan.global_batch_size, plan.steps_per_epoch) == (300, 4)
    run_dir, ids_dir = str(tmp_path / "run"), str(tmp_path / "ids")
    checkpoint_dir = os.path.join(run_dir, "checkpoints")
    spec = make_spec(config, manifest, plan, run_dir)
    env = {EXAMPLE_IDS_ENV: ids_dir, FAULT_ENV: "sleep:worker=0:step=6:seconds=60"}
    logs, resized, outcome = LogCapture(), [], {}

    def run() -> None:
        try:
            outcome["launch"] = launch_on_ray(spec, config, log_fn=logs, env=env, on_resize=resized.append)
        except BaseException as error:  # noqa: BLE001 - re-raised in the test thread
            outcome["error"] = error

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 300
    while 5 not in {r.step for r in manifests.list_checkpoints(checkpoint_dir)}:  # ckpt-5 verified, on 3 workers
        assert time.monotonic() < deadline and thread.is_alive(), (outcome, logs.text[-3000:])
        time.sleep(0.5)
    first = {a.name.rsplit("-", 1)[-1]: a.node_id for a in ray_cluster.alive_actors() if "-1-" in a.name}
    assert sorted(first) == ["chief 0", "ps 0", "worker 0", "worker 1", "worker 2"]
    assert len(set(first.values())) == NUM_TASKS  # a node each: the lost one leaves no spare
    os.kill(ray_cluster.raylet_pid(first["worker 2"]), signal.SIGKILL)
    ray_cluster.forget_node(first["worker 2"])
    second: dict[str, str] = {}  # the second attempt's tasks and their nodes, seen while it runs
    while thread.is_alive() and time.monotonic() < deadline:
        second.update({a.name.rsplit("-", 1)[-1]: a.node_id for a in ray_cluster.alive_actors() if "-2-" in a.name})
        time.sleep(0.5)
    thread.join(timeout=1)
    assert not thread.is_alive(), "the launch did not end within 300 s"
    if "error" in outcome:
        raise outcome["error"]

    launched = outcome["launch"]
    result = launched.result
    assert (result.strategy, result.final_step, result.total_steps) == ("parameter_server", STEPS, STEPS)
    assert (result.global_batch_size, result.num_workers) == (100, 2)
    (shrink,) = result.resizes
    assert (shrink.from_workers, shrink.to_workers, shrink.step) == (3, 2, 5) and "worker 2" in shrink.reason
    assert resized == [shrink] == list(launched.resizes)
    assert "[supervisor] resize 1: 3 → 2 workers at step 5" in logs.text
    # The ps is kept: the second attempt is the chief, the ps and 2 workers, on 4 of the nodes left.
    assert sorted(second) == ["chief 0", "ps 0", "worker 0", "worker 1"]
    assert len(set(second.values())) == 4 and first["worker 2"] not in second.values()
    assert not ray_cluster.alive_actors(), "the run's actors outlived it"
    assert [r.resumed_step for r in launched.restarts] == [5]
    # 15 steps of 100: the coordinator's records of both attempts hold an epoch of 1200 and 300 of a second, each
    # example once.
    assert_coordinator_fed_each_example_once(manifest, config, ids_dir, [(3, 0, 5), (2, 5, STEPS)],
                                             epoch_records=4 * 300, batch_size=100)
