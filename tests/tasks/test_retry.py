"""The retry condition every retried task shares: transient failures retry, bad input never does."""

from __future__ import annotations

import pytest
from prefect.states import Completed, Failed

from pipeline_lib.config import ConfigError
from pipeline_lib.core.errors import TransientError, UserError
from pipeline_lib.core.storage import StorageUnavailable
from tasks.retry import retry_if_transient


def _failed(error: BaseException):
    return Failed(data=error, message=f"Task run encountered unexpected exception: {error!r}")


@pytest.mark.parametrize("error", [
    StorageUnavailable("s3://bucket did not answer"),
    TransientError("server blip"),
    ConnectionError("connection refused"),
    TimeoutError("read timed out"),
], ids=lambda e: type(e).__name__)
def test_transient_failures_retry(error):
    assert retry_if_transient(None, None, _failed(error)) is True


def _raised_from(error: BaseException, cause: BaseException) -> BaseException:
    try:
        raise error from cause
    except BaseException as raised:  # noqa: BLE001 - building a chained exception
        return raised


@pytest.mark.parametrize("error", [
    UserError("data.source x.csv row 3 holds a missing value"),
    ConfigError("train.per_replica_batch_size (0) must be ≥ 1"),
    ValueError("a bug"),
    RuntimeError("evaluation gate failed"),
    _raised_from(UserError("bad credentials"), ConnectionError("refused")),
], ids=["user-error", "config-error", "bug", "gate", "user-error-over-connection-error"])
def test_bad_input_and_bugs_never_retry(error):
    assert retry_if_transient(None, None, _failed(error)) is False


def test_a_state_without_an_exception_does_not_retry():
    assert retry_if_transient(None, None, Completed(data=1)) is False
