"""Tests for pipeline_lib.core.retry: retries with exponential backoff, permanent errors raised at once."""

from __future__ import annotations

import pytest

from pipeline_lib.core import retry


def _flaky(failures: list[Exception], result="done"):
    calls = {"n": 0}

    def fn():
        calls["n"] += 1
        if failures:
            raise failures.pop(0)
        return result

    return fn, calls


def test_transient_errors_are_retried_with_doubling_waits(monkeypatch, caplog):
    waits = []
    monkeypatch.setattr(retry.time, "sleep", waits.append)
    fn, calls = _flaky([ConnectionError("blip"), TimeoutError("slow")])
    assert retry.retry_with_backoff(fn, "uploading x", retries=3, backoff_s=0.5) == "done"
    assert calls["n"] == 3 and waits == [0.5, 1.0]
    assert "uploading x failed (ConnectionError: blip); retry 1 of 3 in 0.5s" in caplog.text


def test_the_last_error_is_raised_once_the_retries_are_spent(monkeypatch):
    monkeypatch.setattr(retry.time, "sleep", lambda s: None)
    fn, calls = _flaky([ConnectionError(str(i)) for i in range(5)])
    with pytest.raises(ConnectionError, match="2"):
        retry.retry_with_backoff(fn, "x", retries=2, backoff_s=1.0)
    assert calls["n"] == 3


def test_permanent_errors_are_not_retried(monkeypatch):
    monkeypatch.setattr(retry.time, "sleep", lambda s: pytest.fail("a permanent error was retried"))
    fn, calls = _flaky([FileNotFoundError("gone")])
    with pytest.raises(FileNotFoundError):
        retry.retry_with_backoff(fn, "x", retries=3, backoff_s=1.0,
                                 is_permanent=lambda error: isinstance(error, FileNotFoundError))
    assert calls["n"] == 1


def test_the_storage_policy_retries_io_errors_and_never_missing_refused_or_mismatching_objects(monkeypatch):
    from pipeline_lib.core.download import ChecksumMismatch
    from pipeline_lib.core.errors import UserError
    from pipeline_lib.core.storage import StorageUnavailable

    permanent = [FileNotFoundError("gone"), PermissionError("refused"), ChecksumMismatch("ab" * 32, 3),
                 UserError("bad input")]
    transient = [ConnectionError("blip"), TimeoutError("slow"), OSError("reset"), StorageUnavailable("outage")]
    assert [retry.is_permanent(e) for e in permanent] == [True] * len(permanent)
    assert [retry.is_permanent(e) for e in transient] == [False] * len(transient)
    waits = []
    monkeypatch.setattr(retry.time, "sleep", waits.append)
    fn, calls = _flaky([OSError("reset"), ChecksumMismatch("ab" * 32, 3)])
    with pytest.raises(ChecksumMismatch):
        retry.RetryPolicy(retries=5, backoff_s=0.25).call(fn, "downloading x")
    assert calls["n"] == 2 and waits == [0.25]
