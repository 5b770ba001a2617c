"""Outages stay retryable: raise_if_outage turns a storage outage into StorageUnavailable and leaves other errors."""

from __future__ import annotations

import pytest

from pipeline_lib.core import storage
from pipeline_lib.core.errors import is_transient
from pipeline_lib.data.errors import ConversionError, raise_if_outage


def _raised_from(cause: BaseException) -> Exception:
    """A client error raised while handling `cause`, as storage clients chain a socket error into their own."""
    try:
        try:
            raise cause
        except BaseException as error:
            raise RuntimeError("Could not connect to the endpoint URL") from error
    except RuntimeError as wrapped:
        return wrapped


@pytest.mark.parametrize("error", [ConnectionRefusedError(111, "Connection refused"), TimeoutError("timed out"),
                                   _raised_from(ConnectionResetError(104, "reset by peer"))])
def test_an_outage_becomes_storage_unavailable_naming_the_uri(error):
    with pytest.raises(storage.StorageUnavailable) as caught:
        raise_if_outage(error, "s3://bucket/raw/a.csv", "opening")
    assert "opening 's3://bucket/raw/a.csv' failed because the storage did not answer" in str(caught.value)
    assert caught.value.__cause__ is error
    assert is_transient(caught.value) and not isinstance(caught.value, ConversionError)


def test_storage_unavailable_passes_through_unchanged():
    error = storage.StorageUnavailable("the endpoint did not answer")
    with pytest.raises(storage.StorageUnavailable) as caught:
        raise_if_outage(error, "s3://bucket/raw/a.csv", "opening")
    assert caught.value is error


@pytest.mark.parametrize("error", [PermissionError("Access Denied"), FileNotFoundError("a.csv"), ValueError("bad"),
                                   OSError(28, "No space left on device")])
def test_errors_that_a_retry_would_not_fix_are_left_to_the_caller(error):
    assert raise_if_outage(error, "s3://bucket/raw/a.csv", "opening") is None
