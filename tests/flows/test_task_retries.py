"""Task retries on the real Prefect server: bad input fails on the first attempt, a transient failure is retried."""

from __future__ import annotations

import pytest

from pipeline_lib.config import parse_config
from pipeline_lib.core.errors import UserError
from pipeline_lib.core.storage import StorageUnavailable

pytestmark = pytest.mark.slow


def _run_count(task_run_id) -> int:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_task_run(task_run_id).run_count


def _config(tmp_path, csv: str):
    source = tmp_path / "raw" / "rows.csv"
    source.parent.mkdir(parents=True)
    source.write_text(csv)
    return parse_config({"name": "retry-test", "data": {"source": str(source), "format": "csv", "label": "label",
                                                                 "missing": "fail"},
                         "output_root": str(tmp_path / "out")})


def test_a_csv_with_a_missing_value_fails_conversion_on_the_first_attempt(tmp_path, prefect_api):
    from prefect import flow

    from tasks import stages

    config = _config(tmp_path, "a,b,label\n1.0,2.0,0\n3.0,,1\n5.0,6.0,0\n")

    @flow(name="retry-user-error")
    def convert_once():
        state = stages.convert_to_tfrecords(config, return_state=True)
        return state.is_failed(), state.state_details.task_run_id, state.result(raise_on_failure=False)

    failed, task_run_id, error = convert_once()
    assert failed and isinstance(error, UserError) and "is missing" in str(error)
    assert _run_count(task_run_id) == 1  # retries=2, but a UserError fails the same way every time


def test_a_transient_storage_failure_is_retried(tmp_path, prefect_api, monkeypatch):
    from prefect import flow

    from pipeline_lib.core import storage
    from tasks import stages

    config = _config(tmp_path, "a,label\n1.0,0\n")
    attempts = []

    def check_storage(config):
        attempts.append(1)
        if len(attempts) == 1:
            raise StorageUnavailable(f"{config.output_root} did not answer (simulated outage)")
        return [config.output_root]

    monkeypatch.setattr(storage, "check_storage", check_storage)

    @flow(name="retry-transient")
    def check_once():
        state = stages.check_storage(config, return_state=True)
        return state.is_completed(), state.state_details.task_run_id

    completed, task_run_id = check_once()
    assert completed
    assert len(attempts) == 2 and _run_count(task_run_id) == 2
