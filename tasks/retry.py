"""When a Prefect task retries: only for failures that may pass on their own (`core.errors.is_transient`)."""

from __future__ import annotations

from typing import Any

from pipeline_lib.core.errors import is_transient

# Every retried task waits this long between attempts.
RETRY_DELAY_SECONDS = 2


def retry_if_transient(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect's `retry_condition_fn`: retry a storage outage or a timeout, never bad input or a failed gate.

    Prefect calls it with the task, its task run and the Failed state it is about to enter; for a raised
    exception the state's data is that exception.

    Returns:
        True when `is_transient(error)`: a TransientError, ConnectionError or TimeoutError, not a UserError.
    """
    error = state.data
    return isinstance(error, BaseException) and is_transient(error)


def transient_retries(retries: int = 2) -> dict[str, Any]:
    """The `@task` options of a task that touches storage or a server: `retries` retries of transient failures."""
    return {"retries": retries, "retry_delay_seconds": RETRY_DELAY_SECONDS, "retry_condition_fn": retry_if_transient}
