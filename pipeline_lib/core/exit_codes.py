"""The exit codes of tfdag's commands and the one-line error rule, written once for the CLI, a worker process
and `tfdag validate-cluster` (how a launcher reads a worker's exit is `pipeline_lib.launch.exits`)."""

from __future__ import annotations

import traceback
from collections.abc import Callable

from pipeline_lib.core.errors import is_user_error

EXIT_OK = 0
EXIT_FAILURE = 1  # failed for a reason other than the input (a worker crashed, a server went away, a bug)
EXIT_BAD_INPUT = 2  # the input is wrong: one line names the value and the fix
EXIT_NOT_BLESSED = 3  # trained, not blessed (the evaluation gate or the model check refused it), not registered
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports Ctrl-C

VERBOSE_HINT = " (run with -v for the traceback)"


def one_line(error: BaseException) -> str:
    """The error's message with its line breaks and runs of spaces folded: one line."""
    return " ".join(str(error).split())


def exit_code_of(error: BaseException) -> int:
    """The exit code a command ends with when `error` ends it: interrupted, bad input (a UserError anywhere in its
    chain) or failure."""
    if isinstance(error, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    return EXIT_BAD_INPUT if is_user_error(error) else EXIT_FAILURE


def run_to_exit_code(body: Callable[[], int], report: Callable[[str], None], *, prefix: str,
                     user_error_prefix: str | None = None, verbose: bool = False,
                     failure_traceback: bool = False) -> int:
    """`body()`'s exit code, or the exit code of what it raised, told to `report` by the one-line rule.

    A UserError is its message on one line (it names the value and the fix), exit 2; an interrupt is
    `interrupted`, exit 130; anything else is `failed: <type>: <message>`, exit 1. The traceback comes before the
    line only when `verbose` (or, with `failure_traceback`, for a failure that is not the input's: a worker's
    launcher shows its output's tail).

    Args:
        body: the command.
        report: where the text goes (stderr, a stream).
        prefix: the start of the line: "tfdag: ", the command's name.
        user_error_prefix: the start of a UserError's line instead of `prefix` (a worker's USER_ERROR_PREFIX, which
            its launcher looks for).
        verbose: tracebacks for every error (`-v`).
        failure_traceback: tracebacks for failures even when not verbose.
    """
    try:
        return body()
    except (Exception, KeyboardInterrupt) as error:  # noqa: BLE001 - every error becomes one line and a code
        code = exit_code_of(error)
        traced = verbose or (failure_traceback and code == EXIT_FAILURE)
        if traced:
            report(traceback.format_exc().rstrip("\n"))
        if code == EXIT_BAD_INPUT:
            report(f"{prefix if user_error_prefix is None else user_error_prefix}{one_line(error)}")
        elif code == EXIT_INTERRUPTED:
            report(f"{prefix}interrupted")
        else:
            report(f"{prefix}failed: {type(error).__name__}: {one_line(error)}" + ("" if traced else VERBOSE_HINT))
        return code
