"""Tests for pipeline_lib.tracking.tracker and its MLflow backend: the one factory, a run's lifecycle through the
interface, and an unreachable server that fails fast with one line."""

from __future__ import annotations

import time

import pytest

from pipeline_lib.tracking import tracker
from pipeline_lib.tracking.client import HTTP_DEFAULTS, create_client
from pipeline_lib.tracking.mlflow_backend import MlflowTracker
from pipeline_lib.tracking.records import RunStatus, TrackingError
from tests.pipeline_lib.tracking.conftest import tracking_config


def test_the_factory_picks_mlflow_unless_a_scheme_is_registered(tmp_path):
    config = tracking_config(tmp_path)
    assert isinstance(tracker.open_tracker(config), MlflowTracker)

    class Other:
        def __init__(self, config):
            self.config = config

    tracker.register_tracker("other", Other)
    try:
        assert isinstance(tracker.open_tracker(tracking_config(tmp_path, mlflow_uri="other://x")), Other)
    finally:
        tracker.TRACKERS.pop("other")


def test_a_run_ends_failed_with_its_stage_and_reopens_running(tmp_path):
    config = tracking_config(tmp_path)
    run = tracker.open_tracker(config).start_run("lifecycle")
    run.log_params({"a": 1})
    run.log_metrics({"accuracy": 0.5})
    run.end(RunStatus.FAILED, failed_stage="train")
    client = create_client(config.mlflow_uri)
    ended = client.get_run(run.run_id)
    assert ended.info.status == "FAILED" and ended.data.tags["tfdag.failed_stage"] == "train"
    assert ended.data.metrics["final_eval_accuracy"] == 0.5

    tracker.open_tracker(config).reopen(run.run_id)
    reopened = client.get_run(run.run_id)
    assert reopened.info.status == "RUNNING" and "tfdag.failed_stage" not in reopened.data.tags


def test_an_unreachable_server_fails_fast_with_one_line(tmp_path, monkeypatch):
    for name in HTTP_DEFAULTS:
        monkeypatch.delenv(name, raising=False)
    config = tracking_config(tmp_path, mlflow_uri="http://user:hunter2@127.0.0.1:9")
    started = time.monotonic()
    with pytest.raises(TrackingError) as raised:
        tracker.open_tracker(config).start_run("unreachable")
    assert time.monotonic() - started < 60
    message = str(raised.value)
    assert "http://user:**********@127.0.0.1:9" in message and "hunter2" not in message, message
    assert "did not answer" in message and "tracking.mlflow_uri" in message and "\n" not in message


def test_a_run_found_by_its_uri_alone_reads_its_artifacts(tmp_path):
    config = tracking_config(tmp_path)
    run = tracker.open_tracker(config).start_run("recorded")
    run.log_artifacts({"config/pipeline.yaml": "name: demo\n"})
    run.end()
    recorded = tracker.open_recorded_run(config.mlflow_uri, run.run_id)
    assert recorded.read_artifact("config/pipeline.yaml") == b"name: demo\n"
    with pytest.raises(Exception, match="missing.txt"):
        recorded.read_artifact("missing.txt")
