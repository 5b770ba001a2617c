"""A new tracking backend is one class and one registry line: the whole training pipeline, in one process, tracked
by the in-memory tracker (`tests/flows/memory_tracker.py`) that `register_tracker` installs for `memory://`."""

from __future__ import annotations

import pytest
import yaml

from pipeline_lib.core import events
from pipeline_lib.tracking import tracker
from pipeline_lib.tracking.stage_record import StageStatus, read_stage_record
from tests.flows.memory_tracker import MemoryStore


@pytest.fixture
def memory_store():
    store = MemoryStore()
    tracker.register_tracker("memory", store.tracker)
    try:
        yield store
    finally:
        tracker.TRACKERS.pop("memory", None)


def memory_config(tmp_path, **overrides):
    from pipeline_lib.config import parse_config
    from tests.flows.test_pipeline_flow import digits_config

    config = digits_config(tmp_path, isolation="none", strategy="default", cpu_replicas=None, steps=30,
                           checkpoint_every_steps=15, log_every_steps=10)
    # Registered whatever the gate says, so that the registration is asserted however a 30-step model fares.
    config["tracking"] = {"mlflow_uri": "memory://tfdag", "experiment": "memory", "registered_model": "digits-mem",
                          "register": "always"}
    config["evaluation"] = {"metrics": ["loss", "accuracy"], "validate_model": False, **overrides}
    return parse_config(config)


def test_a_pipeline_run_tracked_in_memory(memory_store, tmp_path, prefect_api):
    from flows.pipeline import training_pipeline

    config = memory_config(tmp_path)
    assert tracker.open_tracker(config).__class__.__name__ == "MemoryTracker"
    summary = training_pipeline(config)

    run = memory_store.runs[summary.mlflow_run_id]
    assert run.status == "FINISHED" and "tfdag.failed_stage" not in run.tags
    assert run.params["pipeline"] == config.name and run.params["total_steps"] == "30"
    assert run.last("final_eval_accuracy") == pytest.approx(summary.metrics["accuracy"])
    assert any(name.startswith("baseline.") for name in run.metrics)
    assert run.metrics["loss"], "the training loop's metrics sink logs to the same run"
    for artifact in ("config/pipeline.yaml", "data/manifest.json", "reproduce/weights.npz",
                     "evaluation/evaluation.json", "data/statistics.json"):
        assert artifact in run.artifacts, sorted(run.artifacts)
    recorded = tracker.open_tracker(config).get_run(summary.mlflow_run_id)
    recorded_config = yaml.safe_load(recorded.read_artifact("config/pipeline.yaml"))
    assert (recorded_config["name"], recorded_config["tracking"]["mlflow_uri"]) == (config.name, "memory://tfdag")
    assert run.tags["tfdag.blessed"] == str(summary.blessed).lower()
    assert run.datasets == [f"{config.name}-train", f"{config.name}-eval"]
    [version] = memory_store.versions["digits-mem"]
    assert summary.model_version == "1" and version.run_id == summary.mlflow_run_id
    assert version.tags["blessed"] == str(summary.blessed).lower()

    record = read_stage_record(summary.run_dir)
    assert record is not None and record.tracking_run_id == summary.mlflow_run_id
    assert [s.name for s in record.stages][:3] == ["check_storage", "start_tracking_run", "convert_to_tfrecords"]
    assert all(s.status == StageStatus.FINISHED for s in record.stages)
    assert record.stage("convert_to_tfrecords").digests["manifest_fingerprint"] == summary.data_fingerprint
    assert record.stage("consolidate_checkpoints").digests["export_files"]


def test_a_listener_stops_the_run_at_a_stage_boundary(memory_store, tmp_path, prefect_api):
    """The seam a test (or the resume issue) uses: raise KeyboardInterrupt on StageStarted(name)."""
    from flows.pipeline import training_pipeline

    def stop_at_train(event):
        if isinstance(event, events.StageStarted) and event.name == "train":
            raise KeyboardInterrupt

    config = memory_config(tmp_path)
    with events.listening(stop_at_train), pytest.raises(KeyboardInterrupt):
        training_pipeline(config)

    [run] = memory_store.runs.values()
    assert run.status == "KILLED" and run.tags["tfdag.failed_stage"] == "train"
    [run_dir] = (tmp_path / "out" / "runs").iterdir()
    record = read_stage_record(str(run_dir))
    assert record.stage("convert_to_tfrecords").status == StageStatus.FINISHED
    assert record.stage("train").status == StageStatus.KILLED


def test_a_run_stopped_at_evaluate_resumes_in_place_without_converting_or_training_again(memory_store, tmp_path,
                                                                                          prefect_api):
    """`resume="latest"` (what `tfdag run --resume` passes): the same tracked run reopened and FINISHED, the stages the
    stopped attempt finished not run again, a changed config refused naming its keys, a finished run left alone."""
    from flows.pipeline import training_pipeline
    from pipeline_lib.tracking.stage_record import ResumeError

    def stop_at_evaluate(event):
        if isinstance(event, events.StageStarted) and event.name == "evaluate":
            raise KeyboardInterrupt

    config = memory_config(tmp_path)
    with events.listening(stop_at_evaluate), pytest.raises(KeyboardInterrupt):
        training_pipeline(config)
    [(run_id, run)] = memory_store.runs.items()
    assert run.status == "KILLED"

    changed = memory_config(tmp_path, metrics=["loss", "accuracy", "auc"])
    with pytest.raises(ResumeError, match=r"the config changed since that run started, at evaluation\.metrics\[2\]"):
        training_pipeline(changed, resume="latest")

    summary = training_pipeline(config.model_copy(update={"train": config.train.model_copy(
        update={"max_restarts": 7})}), resume="latest")  # a key a resumed run may change
    assert summary.mlflow_run_id == run_id and list(memory_store.runs) == [run_id]
    assert run.status == "FINISHED" and "tfdag.failed_stage" not in run.tags
    assert summary.final_step == 30 and summary.model_version == "1"
    record = read_stage_record(summary.run_dir)
    names = [s.name for s in record.stages]
    for once in ("convert_to_tfrecords", "plan_shards", "train", "consolidate_checkpoints", "log_model", "track"):
        assert names.count(once) == 1, names
    assert [s.status for s in record.stages if s.name == "evaluate"] == [StageStatus.KILLED, StageStatus.FINISHED]
    assert names.index("reopen_tracking_run") > names.index("train")
    assert record.summary is not None

    assert training_pipeline(config, resume=summary.run_name) == summary  # finished: nothing done
    assert read_stage_record(summary.run_dir) == record
