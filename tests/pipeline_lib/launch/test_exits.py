"""Exit classification: which return codes a restart can help, how they read, and peer-failure symptoms."""

from __future__ import annotations

import signal

from pipeline_lib.launch.exits import (
    classify_exit,
    describe_exit,
    peer_failure_line,
    user_error_line,
)
from pipeline_lib.launch.spec import (
    PREEMPTION_EXIT_CODE,
    USER_ERROR_EXIT_CODE,
    USER_ERROR_PREFIX,
)


def test_exit_classes_follow_the_exit_code_policy():
    assert classify_exit(0) == "ok"
    for code in (-signal.SIGKILL, -signal.SIGTERM, 137, 143, 130, PREEMPTION_EXIT_CODE):
        assert classify_exit(code) == "retryable", code
    for code in (1, 2, 3, 139):
        assert classify_exit(code) == "permanent", code


def test_exits_are_described_in_words():
    assert describe_exit(-signal.SIGKILL) == "killed by SIGKILL"
    assert describe_exit(-200) == "killed by signal 200"
    assert describe_exit(PREEMPTION_EXIT_CODE) == "exited 138 (preempted: SIGTERM, checkpoint saved)"
    assert describe_exit(1) == "exited 1 (a Python exception)"
    assert describe_exit(USER_ERROR_EXIT_CODE) == "exited 2 (bad input)"
    assert describe_exit(3) == "exited 3"


def test_user_error_line_is_the_message_of_the_last_user_error_a_worker_printed():
    output = (f"[worker 0] step 1\n[worker 0] {USER_ERROR_PREFIX}first\n"
              f"[worker 0] {USER_ERROR_PREFIX}model.factory 'mlp' rejected model.params ['bogus']; fix it  \n")
    assert user_error_line(output) == "model.factory 'mlp' rejected model.params ['bogus']; fix it"
    assert user_error_line("Traceback (most recent call last)\nValueError: bad label") is None


def test_peer_failure_line_is_the_last_lost_peer_symptom():
    output = ("step 10\nUnavailableError: Socket closed\nmore\n"
              "  Collective ops is aborted by: worker 1 stopped sending heartbeats  \nTraceback")
    assert peer_failure_line(output) == "Collective ops is aborted by: worker 1 stopped sending heartbeats"
    assert peer_failure_line("Traceback (most recent call last)\nValueError: bad label") is None
