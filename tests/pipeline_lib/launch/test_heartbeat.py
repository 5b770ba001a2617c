"""Heartbeat files: throttled atomic writes by a training process, tolerant reads by the watchdog."""

from __future__ import annotations

import json
import os

from pipeline_lib.cluster.info import ClusterInfo
from pipeline_lib.launch.heartbeat import Heartbeat, heartbeat_name, read_heartbeat
from pipeline_lib.training.hooks import Phase


def test_heartbeat_writes_at_most_every_interval(tmp_path):
    cluster = ClusterInfo(task_type="worker", task_index=1, cluster={"worker": ("a:1", "b:2")})
    beat = Heartbeat(str(tmp_path), cluster, interval_s=3600)
    beat.beat(1, 32, force=True)
    beat.beat(2, 32)  # inside the interval: not written
    content = json.loads((tmp_path / "worker-1.json").read_text())
    assert content["step"] == 1 and content["task"] == "worker 1" and content["pid"] == os.getpid()
    beat.beat(3, 32, force=True)
    content = read_heartbeat(str(tmp_path / "worker-1.json"))
    assert content["step"] == 3 and content["examples"] == 96 and content["phase"] == "starting"
    beat.beat(3, 0, phase=Phase.SAVING)  # a phase change is written inside the interval
    assert read_heartbeat(str(tmp_path / "worker-1.json"))["phase"] == "saving"
    assert read_heartbeat(str(tmp_path / "missing.json")) is None




def test_heartbeat_names_follow_the_task():
    cluster = {"chief": ("h:1",), "worker": ("h:2",), "ps": ("h:3",)}
    assert heartbeat_name(ClusterInfo(task_type="chief", task_index=0, cluster=cluster)) == "chief-0.json"
    assert heartbeat_name(ClusterInfo()) == "worker-0.json"


def test_the_chiefs_eval_metrics_ride_on_its_heartbeat(tmp_path):
    from pipeline_lib.launch.heartbeat import EvalOnHeartbeat
    from pipeline_lib.testing.sinks import InMemorySink

    beat = Heartbeat(str(tmp_path), ClusterInfo(), interval_s=0)
    inner = InMemorySink()
    sink = EvalOnHeartbeat(inner, beat)
    sink.log_metrics({"loss": 0.3, "learning_rate": 0.01}, step=10)
    beat.beat(10, 32)
    assert read_heartbeat(str(tmp_path / "worker-0.json"))["eval"] == {}
    sink.log_metrics({"eval_loss": 0.25, "eval_accuracy": 0.9, "eval_nan": float("nan")}, step=20)
    beat.beat(20, 32)
    assert read_heartbeat(str(tmp_path / "worker-0.json"))["eval"] == {"eval_loss": 0.25, "eval_accuracy": 0.9}
    assert [step for step, _ in inner.history] == [10, 20]  # everything reaches the inner sink
    assert inner.series("loss") == [(10, 0.3)] and inner.series("eval_accuracy") == [(20, 0.9)]
