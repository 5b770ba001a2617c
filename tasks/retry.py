"""When a Prefect task retries: only for failures that may pass on their own (`core.errors.is_transient`), and
not for a call a library policy already retried to its end (`core.retry`, which says which layer owns which call)."""

from __future__ import annotations

from typing import Any

from pipeline_lib.core.errors import is_transient
from pipeline_lib.core.retry import retries_spent

# Every retried task waits about this long between attempts.
RETRY_DELAY_SECONDS = 2
# Each wait is drawn around RETRY_DELAY_SECONDS on average (at most this factor more), so tasks that failed together in one
# outage do not retry together.
RETRY_JITTER_FACTOR = 0.5


def retry_if_transient(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect's `retry_condition_fn`: retry a storage outage or a timeout, never bad input or a failed gate, and
    never a transfer the library's storage policy already retried (`core.retry.retries_spent`).

    Prefect calls it with the task, its task run and the Failed state it is about to enter; for a raised
    exception the state's data is that exception.

    Returns:
        True when `is_transient(error)`: a TransientError, ConnectionError or TimeoutError, not a UserError, and
        no library policy spent its retries on it.
    """
    error = state.data
    return isinstance(error, BaseException) and is_transient(error) and not retries_spent(error)


def transient_retries(retries: int = 2) -> dict[str, Any]:
    """The `@task` options of a task that touches storage or a server: `retries` jittered retries of transient
    failures."""
    return {"retries": retries, "retry_delay_seconds": RETRY_DELAY_SECONDS,
            "retry_jitter_factor": RETRY_JITTER_FACTOR, "retry_condition_fn": retry_if_transient}
