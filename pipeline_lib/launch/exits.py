"""How a task's exit reads: retryable or permanent, in words, and whether its output blames a lost peer."""

from __future__ import annotations

import signal

from pipeline_lib.core.exit_codes import EXIT_FAILURE, EXIT_INTERRUPTED
from pipeline_lib.launch.spec import (
    PREEMPTION_EXIT_CODE,
    USER_ERROR_EXIT_CODE,
    USER_ERROR_PREFIX,
)

# Killed (SIGKILL 137, SIGTERM 143, SIGINT 130) or preempted with a checkpoint saved: a restart can help.
RETRYABLE_EXIT_CODES = frozenset({EXIT_INTERRUPTED, 137, 143, PREEMPTION_EXIT_CODE})

# What TensorFlow prints in a healthy worker whose peer died or stopped: a symptom, not that worker's bug.
PEER_FAILURE_MARKERS = (
    "Collective ops is aborted by",
    "tasks are unhealthy",
    "stopped sending heartbeats",
    "UnavailableError",
    "Socket closed",
    "Connection reset by peer",
    "failed to connect to all addresses",
)


def classify_exit(code: int) -> str:
    """'ok', 'retryable' or 'permanent' for a process's return code (negative: killed by that signal)."""
    if code == 0:
        return "ok"
    if code < 0 or code in RETRYABLE_EXIT_CODES:
        return "retryable"
    return "permanent"


def describe_exit(code: int) -> str:
    """A return code in words: `killed by SIGKILL`, `exited 1 (a Python exception)`."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    if code == PREEMPTION_EXIT_CODE:
        return f"exited {code} (preempted: SIGTERM, checkpoint saved)"
    if code == EXIT_FAILURE:
        return f"exited {code} (a Python exception)"
    if code == USER_ERROR_EXIT_CODE:
        return f"exited {code} (bad input)"
    return f"exited {code}"


def user_error_line(output: str) -> str | None:
    """The message of the last USER_ERROR_PREFIX line a worker printed (its UserError), or None."""
    messages = [line.split(USER_ERROR_PREFIX, 1)[1].strip() for line in output.splitlines() if USER_ERROR_PREFIX in line]
    return messages[-1] if messages else None


def peer_failure_line(output: str) -> str | None:
    """The last output line that reports a lost or silent peer, or None when the failure is the task's own."""
    lines = [line.strip() for line in output.splitlines() if any(m in line for m in PEER_FAILURE_MARKERS)]
    return lines[-1][:300] if lines else None
