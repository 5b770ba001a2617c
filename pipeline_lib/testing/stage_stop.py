"""Test-only: stop a run at a stage boundary, through the flow's stage events (`core.events.StageStarted`).

`stop_at_stage("train")` listens to this process's event bus for the length of a block; when the named stage
starts it raises `StageStopped` (a KeyboardInterrupt) from the `emit` call: the run stops there as on Ctrl-C, and
its lifecycle ends it KILLED in that stage. With `signum` it sends this process that signal instead (SIGKILL: the
flow's process dies; SIGTERM: it is asked to stop). Only a flow that runs in the test's own process emits to it.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator

from pipeline_lib.core import events


class StageStopped(KeyboardInterrupt):
    """Raised as the named stage starts. An interrupt, not an Exception: `events.emit` logs and swallows a listener's
    Exception (a display must never stop the run), and this one must stop it, as Ctrl-C would."""

    def __init__(self, stage: str):
        super().__init__(f"stopped by the test as stage {stage!r} started")
        self.stage = stage


@contextlib.contextmanager
def stop_at_stage(stage: str, signum: int | None = None) -> Iterator[list[str]]:
    """Within the block, stop this process's run when `stage` starts (see the module docstring).

    Yields:
        The stages started in the block, in order, the stopped one last: what ran before the stop.
    """
    started: list[str] = []

    def listen(event: events.Event) -> None:
        if not isinstance(event, events.StageStarted):
            return
        started.append(event.name)
        if event.name != stage:
            return
        if signum is None:
            raise StageStopped(stage)
        os.kill(os.getpid(), signal.Signals(signum))

    with events.listening(listen):
        yield started
