"""The stage record's side of a resume: which run `--resume` finds, the kept results and their digests, and what
makes a run not resumable (a changed config, a process still running it)."""

from __future__ import annotations

import os
import socket
import subprocess
import time

import pytest
from pydantic import BaseModel

from pipeline_lib.config import RESUME_SAFE_KEYS, parse_config
from pipeline_lib.core import runs
from pipeline_lib.tracking.stage_record import (
    ResumeError,
    StageEntry,
    StageRecord,
    StageStatus,
    find_run,
    keep_result,
    read_kept,
    resume_point,
    write_stage_record,
)


def _config(tmp_path, name: str = "digits", **train):
    return parse_config({"name": name, "data": {"source": str(tmp_path / "raw.csv"), "label": "y"},
                         "output_root": str(tmp_path / "out"), "train": train})


def _record(config, run_name: str, created_at: float, **fields) -> str:
    run_dir = runs.run_dir_for(config.output_root, run_name)
    write_stage_record(run_dir, StageRecord(pipeline=config.name, run_name=run_name, created_at=created_at,
                                            config=config.model_dump(mode="json"), **fields))
    return run_dir


def test_latest_is_the_newest_run_recording_this_pipeline_name_not_a_name_prefix(tmp_path):
    digits, other = _config(tmp_path), _config(tmp_path, name="digits-v2")
    _record(digits, "digits-20261201T000000Z-aaaaaa", 1.0)
    newest = _record(digits, "digits-20261202T000000Z-bbbbbb", 2.0)
    _record(other, "digits-v2-20261203T000000Z-cccccc", 3.0)
    os.makedirs(runs.run_dir_for(digits.output_root, "digits-20261204T000000Z-dddddd"))  # `tfdag train`: no record
    assert find_run(digits.output_root, "digits")[0] == newest
    assert find_run(digits.output_root, "digits-v2")[1].run_name == "digits-v2-20261203T000000Z-cccccc"


def test_a_run_that_cannot_be_found_or_is_another_pipelines_is_refused_with_the_fix(tmp_path):
    digits = _config(tmp_path)
    with pytest.raises(ResumeError, match=rf"no run of pipeline 'digits' under {runs.runs_dir(digits.output_root)} "
                                          r"to resume; start one with `tfdag run CONFIG`"):
        find_run(digits.output_root, "digits")
    _record(_config(tmp_path, name="other"), "other-1", 1.0)
    with pytest.raises(ResumeError, match=r"that run is pipeline 'other', not 'digits'"):
        find_run(digits.output_root, "digits", "other-1")
    with pytest.raises(ResumeError, match=r"--resume 'nope': .* holds no stage record"):
        find_run(digits.output_root, "digits", "nope")


def test_a_changed_config_is_refused_naming_its_keys_and_the_safe_keys_may_change(tmp_path):
    config = _config(tmp_path)
    _record(config, "digits-1", 1.0)
    with pytest.raises(ResumeError, match=r"the config changed since that run started, at train\.epochs, "
                                          r"train\.seed; .* \(only train\.max_restarts, .* may change\)"):
        resume_point(_config(tmp_path, epochs=3, seed=1))
    safe = _config(tmp_path, max_restarts=9, restart_backoff_s=5.0, hang_timeout_s=10.0, timeout_s=60.0)
    assert {k.split(".")[1] for k in RESUME_SAFE_KEYS} == {"max_restarts", "restart_backoff_s", "hang_timeout_s",
                                                           "timeout_s"}
    assert resume_point(safe)[1].run_name == "digits-1"
    assert safe.config_hash() == config.config_hash(), "the safe keys are not part of the config's hash"
    assert _config(tmp_path, epochs=3).config_hash() != config.config_hash()


def test_a_run_whose_process_is_alive_on_this_host_is_not_resumed(tmp_path):
    config = _config(tmp_path)
    alive = subprocess.Popen(["sleep", "60"])
    try:
        _record(config, "digits-1", 1.0, host=socket.gethostname(), pid=alive.pid)
        with pytest.raises(ResumeError, match=rf"that run is still running \(process {alive.pid} on this host\)"):
            resume_point(config)
    finally:
        alive.kill()
        alive.wait()
    assert resume_point(config)[1].pid == alive.pid  # the process is gone: resumable


class _Result(BaseModel):
    step: int


def test_a_kept_result_is_read_back_only_with_its_digest(tmp_path):
    run_dir = str(tmp_path / "run")
    digest = keep_result(run_dir, "train", _Result(step=40), _Result)
    assert read_kept(run_dir, "train", digest, _Result) == (True, _Result(step=40))
    assert read_kept(run_dir, "train", None, _Result) == (False, None)
    (tmp_path / "run" / "stages" / "train.json").write_text('{"step": 41}')
    assert read_kept(run_dir, "train", digest, _Result) == (False, None), "a changed file is not the stage's result"
    optional = keep_result(run_dir, "track", None, _Result | None)
    assert read_kept(run_dir, "track", optional, _Result | None) == (True, None)


def test_finished_reports_the_last_attempt_of_a_stage(tmp_path):
    now = time.time()
    record = StageRecord(pipeline="p", stages=(
        StageEntry(name="evaluate", status=StageStatus.RUNNING, started_at=now),
        StageEntry(name="train", status=StageStatus.FINISHED, started_at=now),
        StageEntry(name="evaluate", status=StageStatus.FINISHED, started_at=now)))
    assert record.finished("evaluate").status == StageStatus.FINISHED
    assert record.finished("gate") is None
    assert StageRecord(pipeline="p", stages=record.stages[:1]).finished("evaluate") is None
