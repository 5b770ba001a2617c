"""ConversionError for inputs that cannot be converted, kept apart from storage outages, which a retry may fix."""

from __future__ import annotations

from pipeline_lib.core import storage
from pipeline_lib.core.errors import UserError, is_transient


class ConversionError(UserError, ValueError):
    """The source cannot be converted; the message names the file (and line or column) and the fix."""


def raise_if_outage(error: BaseException, uri: str, action: str) -> None:
    """Raise StorageUnavailable naming `uri` when `error` is a storage outage; otherwise return.

    Call it first in every handler that turns errors into a ConversionError: a ConversionError is a UserError,
    which is never retried, so an outage (a refused connection, a timeout) wrapped into one would fail the
    stage for good instead of letting the task's retries ride it out.

    Args:
        error: the exception caught while `action` ran on `uri`.
        uri: the file or directory the storage call was for.
        action: what was being done, for the message ("reading", "listing", "publishing the shard set at").

    Raises:
        StorageUnavailable: when `is_transient(error)`, raised from `error`.
    """
    if isinstance(error, storage.StorageUnavailable):
        raise error
    if is_transient(error):
        raise storage.StorageUnavailable(
            f"{action} {uri!r} failed because the storage did not answer ({type(error).__name__}: {error}); "
            "a retry may succeed; if it keeps failing, check the endpoint and that the server is up"
        ) from error
