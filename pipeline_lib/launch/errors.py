"""Why a launched training did not finish: the errors the local launcher raises."""

from __future__ import annotations

from pipeline_lib.core.errors import TfdagError, UserError


class LaunchError(TfdagError, RuntimeError):
    """The launched training did not finish."""


class WorkerFailed(LaunchError):
    """A task failed permanently (a Python exception): no restart. Names the task and its traceback tail."""

    def __init__(self, message: str, task: str, exit_code: int, tail: str):
        super().__init__(message)
        self.task = task
        self.exit_code = exit_code
        self.tail = tail


class WorkerInputError(WorkerFailed, UserError):
    """A task failed on bad input (its UserError): the message is that error's one line, prefixed by the task."""


class RestartsExhausted(LaunchError):
    """Retryable failures went on after train.max_restarts restarts; `cause` is the last one."""

    def __init__(self, message: str, cause: str):
        super().__init__(message)
        self.cause = cause


class LaunchTimeout(LaunchError):
    """train.timeout_s passed before training finished."""


class ElasticCapacityError(RestartsExhausted):
    """An elastic run lost workers and fewer than train.elastic.min_workers could be placed again: the failure a
    non-elastic run has today, with the counts; `cause` is the loss."""
