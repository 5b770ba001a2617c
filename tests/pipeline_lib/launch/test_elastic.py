"""An elastic run through the local launcher with an injected node loss (`pipeline_lib.testing.local_nodes`: a
file of how many local "nodes" are up): a lost worker is replaced by a resize to the workers that can be placed, and
the group grows back at an agreed checkpoint once capacity returns; real worker processes, real signals, real
checkpoints, and every example of every epoch once, by the example ids the workers record."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
import types
import urllib.request

import pytest

from pipeline_lib.checkpoints import manifests
from pipeline_lib.config import parse_config
from pipeline_lib.launch.errors import ElasticCapacityError
from pipeline_lib.launch.local import LocalGroup, _resize, launch
from pipeline_lib.launch.prometheus import TARGETS_NAME
from pipeline_lib.planning.sharding import plan_for_train
from pipeline_lib.testing.example_ids import EXAMPLE_IDS_ENV, read_record, record_path
from pipeline_lib.testing.faults import FAULT_ENV
from pipeline_lib.testing.local_nodes import local_nodes
from pipeline_lib.training import epochs
from tests.pipeline_lib.launch_support import (
    LogCapture,
    assert_coordinator_fed_each_example_once,
    assert_no_orphans,
    make_config,
    make_spec,
    write_digits_dataset,
)


@pytest.fixture(autouse=True)
def no_orphans():
    yield
    assert_no_orphans()


def _supervisor_gauge(run_dir: str, name: str) -> float:
    """The value of `name` on the run's supervisor endpoint, found in the run's Prometheus targets file."""
    from prometheus_client.parser import text_string_to_metric_families

    with open(os.path.join(run_dir, TARGETS_NAME)) as handle:
        target = next(g["targets"][0] for g in json.load(handle) if g["labels"]["task_type"] == "supervisor")
    with urllib.request.urlopen(f"http://{target}/metrics", timeout=5) as response:
        text = response.read().decode()
    return next(s.value for family in text_string_to_metric_families(text) for s in family.samples if s.name == name)


def _saved_rate(prefix: str) -> float:
    import tensorflow as tf

    reader = tf.train.load_checkpoint(prefix)
    return float(reader.get_tensor("optimizer/_learning_rate/.ATTRIBUTES/VARIABLE_VALUE"))


@pytest.mark.slow
def test_a_lost_worker_shrinks_the_group_and_returning_capacity_grows_it_back_every_example_once(tmp_path):
    """3 workers × 25 (global batch 75: 19 steps and 1425 records per epoch of digits' 1437), 45 steps. Worker 2 is
    SIGKILLed after step 14 with only 2 local "nodes" up: the group resumes from ckpt-12 on 2 workers (75 does not
    split over 2: global batch 74). The third node is back as soon as the shrink is told, and a slow step 20 (6 s)
    makes sure the supervisor's check (every 3 s) sees it while the 2 workers run: it stops them at an agreed
    checkpoint (by step 21) and resumes on 3 workers, to step 45 exactly. The rate follows the global batch,
    linearly."""
    import tensorflow as tf

    manifest = write_digits_dataset(str(tmp_path / "digits"), example_ids=True)
    config = make_config(str(tmp_path), label="target", workers=3, per_replica_batch_size=25, steps=45,
                         checkpoint_every_steps=6, keep_checkpoints=10, shuffle=True, shuffle_buffer=2000,
                         base_learning_rate=0.002, max_restarts=1, elastic={"min_workers": 2, "wait_s": 1.0},
                         early_stopping={"enabled": False})
    plan = plan_for_train(manifest, config.train, 1)
    assert (plan.global_batch_size, plan.steps_per_epoch, plan.total_steps) == (75, 19, 45)
    run_dir, ids_dir, nodes = str(tmp_path / "run"), str(tmp_path / "ids"), tmp_path / "nodes"
    nodes.write_text("2")  # read only when a worker is lost: then one node of three is gone
    env = {FAULT_ENV: "kill:worker=2:step=14,sleep:worker=0:step=20:seconds=6", EXAMPLE_IDS_ENV: ids_dir}
    logs, resized = LogCapture(), []

    scraped: list[float] = []

    def node_returns() -> None:  # the lost node comes back once the group runs on 2
        deadline = time.monotonic() + 240
        while not resized and time.monotonic() < deadline:
            time.sleep(0.1)
        scraped.append(_supervisor_gauge(run_dir, "tfdag_workers"))  # what Prometheus sees meanwhile
        nodes.write_text("3")

    returning = threading.Thread(target=node_returns, daemon=True)
    returning.start()
    with local_nodes(nodes):
        outcome = launch(make_spec(config, manifest, plan, run_dir), config, log_fn=logs, env=env,
                         on_resize=resized.append)
    returning.join(timeout=5)

    result = outcome.result
    assert (result.final_step, result.total_steps, result.num_workers, result.global_batch_size) == (45, 45, 3, 75)
    shrink, grow = result.resizes
    assert (shrink.from_workers, shrink.to_workers, shrink.step) == (3, 2, 12)
    assert "worker 2 killed by SIGKILL" in shrink.reason
    assert "2 of 3 workers could be placed within train.elastic.wait_s (1 s)" in shrink.reason
    assert (grow.from_workers, grow.to_workers) == (2, 3) and 12 < grow.step <= 21
    assert grow.reason == "3 of 3 workers can be placed again"
    assert resized == list(result.resizes) == list(outcome.resizes)
    assert scraped == [2.0]
    assert [r.resumed_step for r in outcome.restarts] == [12] and outcome.num_attempts == 3  # the grow is no restart
    assert "[supervisor] resize 1: 3 → 2 workers at step 12: worker 2 killed by SIGKILL" in logs.text
    assert f"[supervisor] resize 2: 2 → 3 workers at step {grow.step}: 3 of 3 workers can be placed again" in logs.text
    assert "elastic attempt on 2 worker(s): global batch 74 (the configured 75 does not split" in logs.text
    checkpoints = os.path.join(run_dir, "checkpoints")
    positions = {r.step: r.data_position for r in manifests.list_checkpoints(checkpoints)}
    assert (positions[12].records, positions[12].num_workers, positions[12].global_batch) == (12 * 75, 3, 75)
    grown = positions[grow.step]
    assert (grown.records, grown.num_workers, grown.global_batch, grown.configured_global_batch) == (
        12 * 75 + (grow.step - 12) * 74, 2, 74, 75)
    assert positions[45].records == grown.records + (45 - grow.step) * 75 and positions[45].num_workers == 3
    # The optimizer trained at the attempt's rate: 0.006 on 3 workers, 0.002 × 74/25 on 2, 0.006 again.
    assert [_saved_rate(os.path.join(checkpoints, f"ckpt-{step}")) for step in (12, grow.step, 45)] == pytest.approx(
        [0.002 * 3, 0.002 * 74 / 25, 0.002 * 3])

    # Every example of every epoch once across the three groups (each record's batches past its group's last step
    # were read ahead and never trained).
    consumed = []
    for workers, start, steps in ((3, 0, 12), (2, 12, grow.step - 12), (3, grow.step, 45 - grow.step)):
        fed = [read_record(record_path(ids_dir, w, workers, start)) for w in range(workers)]
        assert all(len(batches) >= steps for batches in fed)
        consumed += [i for step in range(steps) for batches in fed for i in batches[step]]
    assert len(consumed) == 12 * 75 + (grow.step - 12) * 74 + (45 - grow.step) * 75  # 2 epochs and part of a third
    per_epoch = [consumed[start:start + 1425] for start in range(0, len(consumed), 1425)]
    assert [len(set(epoch)) for epoch in per_epoch] == [1425, 1425, len(consumed) - 2850]
    assert set(consumed) <= set(range(1437))
    # And it is the order the elastic stream defines, whatever the split: the same ids one by one on one worker.
    tf.keras.utils.set_random_seed(config.train.seed)  # as every worker seeds
    expected = epochs.elastic_records(manifest, config.train, epoch_records=1425, start_record=0, global_batch=1,
                                      num_workers=1, worker=0, num_steps=len(consumed), with_ids=True)
    assert consumed == [int(i) for i in expected.as_numpy_iterator()]


class _RecordingGroup(LocalGroup):
    """The local group, keeping each started task's process by name (`worker 2`), so a test can kill one."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.processes: dict[str, object] = {}
        self.started: list[str] = []

    def start(self, task, log_fn, log_lock):
        process = super().start(task, log_fn, log_lock)
        self.processes[task.name] = process
        self.started.append(task.name)
        return process


@pytest.mark.slow
def test_parameter_server_keeps_its_server_shrinks_and_grows_back_its_workers_every_example_once(tmp_path):
    """A parameter-server run of 3 workers and 1 ps, steps of 100 examples (one worker's batch; the plan's global
    batch 300 cuts each epoch to 1200 records: 12 steps), 25 steps. After the chief's step 7 its process is stopped
    (so the attempt ends there, whatever the chief's speed) and worker 2's is SIGKILLed with only 2 local "nodes" up:
    the group restarts from ckpt-5 with the ps and 2 workers. The third node is back as soon as the shrink is told,
    and a slow step 12 (3 s) makes sure the supervisor's check (every 3 s) sees it while the chief steps: it stops the
    chief (not the servers, which would end before its save) at an agreed checkpoint and restarts the group with the
    ps and 3 workers, to step 25 exactly, at the same batch and rate. The
    coordinator ships each step's batch in the global order, so the example ids of the three attempts are that
    order: every example of each of the two epochs (and part of a third) once."""
    manifest = write_digits_dataset(str(tmp_path / "digits"), example_ids=True)
    config = make_config(str(tmp_path), label="target", strategy="parameter_server", workers=3, parameter_servers=1,
                         per_replica_batch_size=100, steps=25, checkpoint_every_steps=5, log_every_steps=1,
                         keep_checkpoints=10, shuffle=True, shuffle_buffer=2000, base_learning_rate=0.01,
                         max_restarts=1, elastic={"min_workers": 2, "wait_s": 1.0}, early_stopping={"enabled": False})
    plan = plan_for_train(manifest, config.train, 1)
    assert (plan.global_batch_size, plan.steps_per_epoch) == (300, 4)
    run_dir, ids_dir, nodes = str(tmp_path / "run"), str(tmp_path / "ids"), tmp_path / "nodes"
    nodes.write_text("2")
    spec = make_spec(config, manifest, plan, run_dir)
    group = _RecordingGroup(spec, config, {EXAMPLE_IDS_ENV: ids_dir, FAULT_ENV: "sleep:worker=0:step=12:seconds=3"})
    logs, killed, resized = LogCapture(), [], []

    def kill_worker_2(line: str) -> None:
        logs(line)
        step = re.match(r"\[chief 0\].*train \| step:\s+(\d+)", line)
        if step and int(step.group(1)) >= 7 and not killed:
            killed.append(int(step.group(1)))
            os.kill(group.processes["chief 0"].popen.pid, signal.SIGSTOP)  # the fence kills it
            os.kill(group.processes["worker 2"].popen.pid, signal.SIGKILL)

    def node_returns(record) -> None:
        resized.append(record)
        nodes.write_text("3")

    with local_nodes(nodes):
        outcome = launch(spec, config, log_fn=kill_worker_2, group=group, on_resize=node_returns)

    result = outcome.result
    assert (result.strategy, result.final_step, result.total_steps) == ("parameter_server", 25, 25)
    assert (result.global_batch_size, result.scaled_learning_rate) == (100, pytest.approx(0.01))
    shrink, grow = result.resizes
    assert (shrink.from_workers, shrink.to_workers, shrink.step) == (3, 2, 5)
    assert "worker 2 killed by SIGKILL" in shrink.reason
    assert (grow.from_workers, grow.to_workers) == (2, 3) and 5 < grow.step <= 13
    assert grow.reason == "3 of 3 workers can be placed again"
    assert resized == list(result.resizes) == list(outcome.resizes)
    assert [r.resumed_step for r in outcome.restarts] == [5] and outcome.num_attempts == 3  # the grow is no restart
    assert "[supervisor] resize 1: 3 → 2 workers at step 5: worker 2 killed by SIGKILL" in logs.text
    assert f"[supervisor] resize 2: 2 → 3 workers at step {grow.step}: 3 of 3 workers can be placed again" in logs.text
    # The servers are kept: each attempt is the chief, its workers and the ps.
    attempts = [group.started[:5], group.started[5:9], group.started[9:]]
    assert [set(a) for a in attempts] == [{"chief 0", "ps 0", "worker 0", "worker 1", "worker 2"},
                                          {"chief 0", "ps 0", "worker 0", "worker 1"},
                                          {"chief 0", "ps 0", "worker 0", "worker 1", "worker 2"}]
    assert "elastic attempt on 2 worker(s): global batch 100, 100 per replica" in logs.text
    positions = {r.step: r.data_position for r in manifests.list_checkpoints(os.path.join(run_dir, "checkpoints"))}
    assert (positions[grow.step].records, positions[grow.step].num_workers) == (grow.step * 100, 2)
    assert (positions[25].records, positions[25].num_workers, positions[25].global_batch) == (25 * 100, 3, 100)

    # One record (the coordinator's) per attempt; each attempt trained the first batches of its record, in order:
    # 2 epochs of 1200 records and 100 of a third.
    assert_coordinator_fed_each_example_once(manifest, config, ids_dir, [(3, 0, 5), (2, 5, grow.step),
                                                                         (3, grow.step, 25)],
                                             epoch_records=4 * 300, batch_size=100)


class _Group:
    def __init__(self, placeable: int):
        self.placeable = placeable
        self.asked: list[float] = []

    def capacity(self, wait_s: float) -> int:
        self.asked.append(wait_s)
        return self.placeable


def _supervisor(placeable: int, workers: int = 3, min_workers: int = 2):
    config = parse_config({"name": "x", "data": {"source": "x.csv", "label": "y"},
                           "train": {"workers": workers, "elastic": {"min_workers": min_workers, "wait_s": 7}}})
    return types.SimpleNamespace(config=config, group=_Group(placeable), log_lock=threading.Lock())


def test_fewer_placeable_workers_than_min_workers_fails_with_the_counts_and_the_fixes():
    supervisor = _supervisor(placeable=1)
    with pytest.raises(ElasticCapacityError) as raised:
        _resize(supervisor, [], 3, "worker 1 killed by SIGKILL", 7.0, lambda line: None)
    assert supervisor.group.asked == [7.0]
    assert str(raised.value) == (
        "worker 1 killed by SIGKILL; only 1 of train.workers (3) workers could be placed within train.elastic.wait_s "
        "(7 s), fewer than train.elastic.min_workers (2): add capacity (nodes with the workers' resources), lower "
        "train.elastic.min_workers, or raise train.elastic.wait_s")


def test_a_resize_is_recorded_only_when_the_count_changes():
    resizes, lines = [], []
    assert _resize(_supervisor(placeable=3), resizes, 3, "worker 1 killed by SIGKILL", 7.0, lines.append) == 3
    assert resizes == [] and lines == []
    assert _resize(_supervisor(placeable=2), resizes, 3, "worker 1 killed by SIGKILL", 7.0, lines.append) == 2
    assert [(r.number, r.from_workers, r.to_workers, r.step) for r in resizes] == [(1, 3, 2, None)]
    assert lines == [("[supervisor] resizing the group from 3 to 2 workers: worker 1 killed by SIGKILL; 2 of 3 "
                      "workers could be placed within train.elastic.wait_s (7 s)")]
