"""`tfdag run` loads its config (and, resuming, finds the run to resume) once, before TensorFlow's import: what
loading raised is what the command reports, and the model check's process starts only for a check still to come."""

from __future__ import annotations

import argparse
import time

import pytest

from flows import cli, flow_config
from pipeline_lib.config import ConfigError
from pipeline_lib.core.exit_codes import EXIT_BAD_INPUT
from pipeline_lib.serving import fresh_process
from pipeline_lib.tracking import stage_record
from pipeline_lib.tracking.stage_record import StageEntry, StageRecord, StageStatus


def test_tfdag_run_loads_its_config_once_and_reports_what_loading_raised(monkeypatch, capsys):
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.2:9/api")  # chosen as given: main() sets nothing else
    monkeypatch.setenv("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    loads = []

    def refuse(path):
        loads.append(path)
        raise ConfigError(f"{path}: train.epochs is 0; set it to 1 or more")

    monkeypatch.setattr(flow_config, "load", refuse)

    assert cli.main(["run", "bad.yaml"]) == EXIT_BAD_INPUT
    assert loads == ["bad.yaml"]
    assert "bad.yaml: train.epochs is 0; set it to 1 or more" in capsys.readouterr().err


def _record(*finished: str) -> StageRecord:
    return StageRecord(pipeline="digits", run_name="digits-1", stages=tuple(
        StageEntry(name=name, status=StageStatus.FINISHED, started_at=time.time()) for name in finished))


@pytest.mark.parametrize("finished,starts", [
    (("convert_to_tfrecords", "train"), True),  # the check is still to come: its process starts now
    (("convert_to_tfrecords", "train", "validate_model"), False),  # an earlier attempt checked the model
])
def test_a_resumed_run_starts_the_model_checks_process_only_when_its_check_is_still_to_come(monkeypatch, finished,
                                                                                          starts):
    config = flow_config.load(None)
    earlier = _record(*finished)
    started = []
    monkeypatch.setattr(flow_config, "load", lambda path: config)
    monkeypatch.setattr(stage_record, "resume_point", lambda config, name: ("runs/digits-1", earlier))
    monkeypatch.setattr(fresh_process, "warm_up", lambda *args: started.append(args))
    args = argparse.Namespace(config=None, resume="latest")

    cli._load_run(args)

    assert args.loaded == (config, earlier)
    assert bool(started) is starts
