"""The retry policy of storage transfers (staging, checkpoint publishing), written once: how many retries, how long
between them, and which errors a retry cannot help."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from pipeline_lib.core.errors import TfdagError, is_transient

logger = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_RETRIES = 3
BACKOFF_S = 1.0


def is_permanent(error: BaseException) -> bool:
    """Whether a retry of a storage transfer cannot help: the object is missing (FileNotFoundError), access is
    refused (PermissionError), or tfdag raised the error on purpose and it is not transient (a checksum mismatch:
    the object is not the one recorded; bad input; a verdict already given, such as a PublishError).

    Everything else (an I/O or network error of fsspec or its backend, a StorageUnavailable) may pass: retried.
    """
    if isinstance(error, (FileNotFoundError, PermissionError)):
        return True
    return isinstance(error, TfdagError) and not is_transient(error)


@dataclass(frozen=True)
class RetryPolicy:
    """How a storage transfer retries: `retries` after the first attempt, waits of backoff_s, 2·backoff_s, ...,
    never for a permanent error (`is_permanent`)."""

    retries: int = DEFAULT_RETRIES
    backoff_s: float = BACKOFF_S

    def call(self, fn: Callable[[], T], what: str, *, retries: int | None = None) -> T:
        """`fn()` under this policy (`retries` overrides the policy's count)."""
        return retry_with_backoff(fn, what, retries=self.retries if retries is None else retries,
                                  backoff_s=self.backoff_s, is_permanent=is_permanent)


# The one policy of every storage transfer (tests replace it with one that does not wait).
STORAGE_RETRY = RetryPolicy()


def retry_with_backoff(fn: Callable[[], T], what: str, *, retries: int, backoff_s: float,
                       is_permanent: Callable[[Exception], bool] = lambda error: False) -> T:
    """Call `fn`; on an exception retry it up to `retries` times, waiting backoff_s, 2·backoff_s, 4·backoff_s...

    Args:
        fn: the call to make.
        what: the operation in words, for the log line of each retry ("uploading s3://b/x").
        retries: retries after the first attempt.
        backoff_s: the first wait; each later one doubles.
        is_permanent: errors for which a retry cannot help (missing, refused): raised at once.

    Returns:
        What `fn` returned.

    Raises:
        Exception: a permanent error at once, or the last error once the retries are spent.
    """
    attempt = 0
    while True:
        try:
            return fn()
        except Exception as error:
            if is_permanent(error) or attempt >= retries:
                raise
            attempt += 1
            delay = backoff_s * 2 ** (attempt - 1)
            logger.warning("%s failed (%s: %s); retry %d of %d in %.1fs", what, type(error).__name__, error,
                           attempt, retries, delay)
            time.sleep(delay)
