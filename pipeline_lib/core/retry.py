"""Retry with exponential backoff: the one retry rule of storage transfers (staging, checkpoint publishing)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")


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
