"""The error hierarchy: every tfdag error is a TfdagError; those caused by input are UserErrors."""

from __future__ import annotations


class TfdagError(Exception):
    """Base of every error tfdag raises on purpose."""


class UserError(TfdagError):
    """Caused by input: config, data, TF_CONFIG, model factory, strategy, tracking URI, storage credentials.

    Raised before any cluster starts wherever the input can be checked then. The message names the value, where it
    came from and the fix; the CLI prints it as one line without a traceback and exits 2. It fails the same way on
    every attempt, so it is never retried.
    """


class TransientError(TfdagError):
    """A failure that may pass on its own (a storage outage, a server that did not answer): worth a retry."""


# Builtin errors that come from I/O and the network, not from the input: a retry may see them pass.
_TRANSIENT_BUILTINS: tuple[type[BaseException], ...] = (ConnectionError, TimeoutError)


def is_user_error(error: BaseException) -> bool:
    """Whether `error`, or an error it was raised from, is a UserError."""
    return any(isinstance(e, UserError) for e in _chain(error))


def is_transient(error: BaseException) -> bool:
    """Whether a retry may succeed where `error` failed.

    A UserError anywhere in the chain fails the same way again: never transient. Otherwise a TransientError or a
    connection or timeout error anywhere in the chain is transient; everything else (bad records, a failed gate,
    a bug) is not.
    """
    chain = list(_chain(error))
    if any(isinstance(e, UserError) for e in chain):
        return False
    return any(isinstance(e, (TransientError, *_TRANSIENT_BUILTINS)) for e in chain)


def _chain(error: BaseException):
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__
