"""A TensorBoard profiler trace of `observability.profile_steps` on the chief, as its loop action."""

from __future__ import annotations

import logging

import tensorflow as tf

from pipeline_lib.checkpoints.records import CheckpointRecord
from pipeline_lib.training.actions.base import LoopAction
from pipeline_lib.training.early_stopping import EarlyStop
from pipeline_lib.training.hooks import Execution

logger = logging.getLogger(__name__)


class ProfileWindow(LoopAction):
    """Traces global steps [start, stop) into `logdir` (its `plugins/profile/<time>/<host>.xplane.pb`), once; the
    window's edges end executions, so the trace holds exactly those steps."""

    def __init__(self, start: int, stop: int, logdir: str):
        self.start, self.stop, self.logdir = start, stop, logdir
        self.active = False
        self.done = False

    def on_start(self, step: int, restored: CheckpointRecord | None) -> EarlyStop | None:
        self.at(step)
        return None

    def next_boundary(self, step: int) -> int | None:
        """The next step at which the trace starts or stops, when one is ahead of `step`."""
        for boundary in (self.start, self.stop):
            if not self.done and boundary > step:
                return boundary
        return None

    def after_execution(self, execution: Execution) -> None:
        self.at(execution.step)

    def at(self, step: int) -> None:
        """Start the trace when `step` enters the window, stop it when it leaves (or at the end)."""
        if self.done:
            return
        if not self.active and self.start <= step < self.stop:
            tf.profiler.experimental.start(self.logdir)
            self.active = True
            logger.info("profiling steps %d-%d into %s", step, self.stop, self.logdir)
        elif self.active and step >= self.stop:
            self.close()

    def close(self) -> None:
        if self.active:
            tf.profiler.experimental.stop()
            logger.info("profile written under %s/plugins/profile", self.logdir)
        self.active, self.done = False, True
