"""Tests for pipeline_lib.core.retry: jittered exponential waits, permanent errors raised at once, spent retries
marked for the layers above."""

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


def test_transient_errors_are_retried_with_jittered_doubling_waits(caplog):
    waits = []
    policy = retry.RetryPolicy(retries=4, backoff_s=0.5, max_backoff_s=1.5, sleep_fn=waits.append)
    fn, calls = _flaky([ConnectionError("blip"), TimeoutError("slow"), OSError("reset"), OSError("reset")])
    assert policy.call(fn, "uploading x") == "done"
    assert calls["n"] == 5 and len(waits) == 4
    # Full jitter: each wait lies in [0, backoff_s · 2^(retry-1)], capped at max_backoff_s.
    assert all(0.0 <= wait <= bound for wait, bound in zip(waits, [0.5, 1.0, 1.5, 1.5]))
    assert "uploading x failed (ConnectionError: blip); retry 1 of 4 in " in caplog.text


def test_waits_are_jittered():
    waits = []
    policy = retry.RetryPolicy(retries=20, backoff_s=1.0, max_backoff_s=1.0, sleep_fn=waits.append)
    fn, _ = _flaky([ConnectionError(str(i)) for i in range(20)])
    policy.call(fn, "x")
    assert len(set(waits)) > 1


def test_the_last_error_is_raised_once_the_retries_are_spent_and_marked():
    fn, calls = _flaky([ConnectionError(str(i)) for i in range(5)])
    with pytest.raises(ConnectionError, match="2") as caught:
        retry.RetryPolicy(sleep_fn=lambda s: None).call(fn, "x", retries=2)
    assert calls["n"] == 3
    assert retry.retries_spent(caught.value)
    try:  # a caller's own error raised from it is spent too: a Prefect task does not retry it again
        raise RuntimeError("could not download x") from caught.value
    except RuntimeError as wrapped:
        assert retry.retries_spent(wrapped)
    assert not retry.retries_spent(ConnectionError("fresh"))


def test_the_storage_policy_retries_io_errors_and_never_missing_refused_or_mismatching_objects():
    from pipeline_lib.core.download import ChecksumMismatch
    from pipeline_lib.core.errors import UserError
    from pipeline_lib.core.storage import StorageUnavailable

    permanent = [FileNotFoundError("gone"), PermissionError("refused"), ChecksumMismatch("ab" * 32, 3),
                 UserError("bad input")]
    transient = [ConnectionError("blip"), TimeoutError("slow"), OSError("reset"), StorageUnavailable("outage")]
    assert [retry.is_permanent(e) for e in permanent] == [True] * len(permanent)
    assert [retry.is_permanent(e) for e in transient] == [False] * len(transient)
    waits = []
    fn, calls = _flaky([OSError("reset"), ChecksumMismatch("ab" * 32, 3)])
    with pytest.raises(ChecksumMismatch) as caught:
        retry.RetryPolicy(retries=5, backoff_s=0.25, sleep_fn=waits.append).call(fn, "downloading x")
    assert calls["n"] == 2 and len(waits) == 1 and 0.0 <= waits[0] <= 0.25
    assert not retry.retries_spent(caught.value)  # permanent: raised at once, not retried

