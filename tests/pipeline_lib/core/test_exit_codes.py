"""Tests for pipeline_lib.core.exit_codes: the exit codes and the one-line error rule of every tfdag command."""

from __future__ import annotations

from pipeline_lib.core import exit_codes
from pipeline_lib.core.errors import UserError


def _run(body, **options) -> tuple[int, list[str]]:
    lines: list[str] = []
    return exit_codes.run_to_exit_code(body, lines.append, prefix="tfdag: ", **options), lines


def _raise(error: BaseException):
    def body() -> int:
        raise error
    return body


def test_a_user_error_is_one_line_and_exit_2_even_when_raised_from_another_error():
    def body() -> int:
        try:
            raise UserError("train.per_replica_batch_size (0)\n   in digits.yaml must be ≥ 1")
        except UserError as error:
            raise RuntimeError("the stage failed") from error

    code, lines = _run(body)
    assert code == exit_codes.EXIT_BAD_INPUT == 2
    assert lines == ["tfdag: the stage failed"]
    code, lines = _run(_raise(UserError("a\n  b")))
    assert (code, lines) == (2, ["tfdag: a b"])


def test_a_failure_is_exit_1_with_its_type_and_the_traceback_only_when_verbose():
    code, lines = _run(_raise(ValueError("boom")))
    assert (code, lines) == (1, ["tfdag: failed: ValueError: boom (run with -v for the traceback)"])
    code, lines = _run(_raise(ValueError("boom")), verbose=True)
    assert code == 1 and lines[0].startswith("Traceback (most recent call last)")
    assert lines[1] == "tfdag: failed: ValueError: boom"
    code, lines = _run(_raise(UserError("bad")), verbose=True)
    assert code == 2 and lines[0].startswith("Traceback") and lines[1] == "tfdag: bad"


def test_the_worker_reading_keeps_user_errors_to_its_prefixed_line_and_traces_failures():
    options = {"user_error_prefix": "tfdag user error: ", "failure_traceback": True}
    assert _run(_raise(UserError("bad")), **options) == (2, ["tfdag user error: bad"])
    code, lines = _run(_raise(ValueError("boom")), **options)
    assert code == 1 and lines[0].startswith("Traceback") and lines[1] == "tfdag: failed: ValueError: boom"


def test_an_interrupt_is_130_and_a_clean_body_returns_its_own_code():
    assert _run(_raise(KeyboardInterrupt())) == (exit_codes.EXIT_INTERRUPTED, ["tfdag: interrupted"])
    assert _run(lambda: exit_codes.EXIT_NOT_BLESSED) == (3, [])
