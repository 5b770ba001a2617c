"""The retry policy of storage transfers (shard staging, checkpoint publishing and fetching), written once on
tenacity: how many retries, jittered exponential waits, and which errors a retry cannot help.

One layer owns each call, so retries never multiply:

- **A storage transfer in the library** (`training.staging` downloading a shard, `checkpoints.publish` putting,
  reading or removing a checkpoint file) retries under `STORAGE_RETRY`. These run in worker processes and
  outside Prefect (the CLI, a notebook), where no task retries them. An error that spent this policy's retries is
  marked (`retries_spent`) and the Prefect task around it, if any, does not retry it again.
- **A Prefect task** (`tasks.retry.transient_retries`: check_storage, convert_to_tfrecords, log_model, track,
  predict_table, ...) retries the whole task on a transient failure, with jitter, for the calls no library policy
  wraps: MLflow's client, storage listings and writes of conversion, the registry.
- **The storage client itself** (botocore, gcsfs, azure-core) retries one HTTP request on a throttle or a reset;
  that is below a transfer and not configured here. MLflow's own HTTP retries are bounded in `tracking.client`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import tenacity

from pipeline_lib.core.errors import TfdagError, is_transient

logger = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_RETRIES = 3
BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0
# Set on an error once a policy has retried it to the end: an outer layer (a Prefect task) must not retry it again.
_SPENT = "_tfdag_retries_spent"


def is_permanent(error: BaseException) -> bool:
    """Whether a retry of a storage transfer cannot help: the object is missing (FileNotFoundError), access is
    refused (PermissionError), or tfdag raised the error on purpose and it is not transient (a checksum mismatch:
    the object is not the one recorded; bad input; a verdict already given, such as a PublishError).

    Everything else (an I/O or network error of fsspec or its backend, a StorageUnavailable) may pass: retried.
    """
    if isinstance(error, (FileNotFoundError, PermissionError)):
        return True
    return isinstance(error, TfdagError) and not is_transient(error)


def retries_spent(error: BaseException) -> bool:
    """Whether `error`, or an error it was raised from, already went through a library retry policy to its end."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if getattr(current, _SPENT, False):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


def _log_retry(what: str, retries: int) -> Callable[[tenacity.RetryCallState], None]:
    def log(state: tenacity.RetryCallState) -> None:
        error = state.outcome.exception() if state.outcome else None
        wait = state.next_action.sleep if state.next_action else 0.0
        logger.warning("%s failed (%s: %s); retry %d of %d in %.1fs", what, type(error).__name__, error,
                       state.attempt_number, retries, wait)
    return log


@dataclass(frozen=True)
class RetryPolicy:
    """How a storage transfer retries: `retries` after the first attempt, each wait drawn uniformly from
    [0, backoff_s · 2^(retry-1)] capped at max_backoff_s (full jitter: workers that failed together do not retry
    together), never for a permanent error (`is_permanent`)."""

    retries: int = DEFAULT_RETRIES
    backoff_s: float = BACKOFF_S
    max_backoff_s: float = MAX_BACKOFF_S
    sleep_fn: Callable[[float], None] = time.sleep

    def call(self, fn: Callable[[], T], what: str, *, retries: int | None = None) -> T:
        """`fn()` under this policy (`retries` overrides the policy's count).

        Args:
            fn: the call to make.
            what: the operation in words, for the log line of each retry ("uploading s3://b/x").
            retries: retries after the first attempt; default the policy's.

        Returns:
            What `fn` returned.

        Raises:
            Exception: a permanent error at once, or the last error once the retries are spent (marked so that
                `retries_spent` is true of it and of any error raised from it).
        """
        retries = self.retries if retries is None else retries
        retrying = tenacity.Retrying(
            stop=tenacity.stop_after_attempt(retries + 1),
            wait=tenacity.wait_random_exponential(multiplier=self.backoff_s, max=self.max_backoff_s),
            retry=tenacity.retry_if_exception(lambda error: not is_permanent(error)),
            before_sleep=_log_retry(what, retries), sleep=self.sleep_fn, reraise=True)
        try:
            return retrying(fn)
        except Exception as error:
            if not is_permanent(error):
                setattr(error, _SPENT, True)
            raise


# The one policy of every storage transfer (tests replace it with one that does not wait).
STORAGE_RETRY = RetryPolicy()
