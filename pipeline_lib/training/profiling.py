"""TensorBoard's profiler on a run: a trace of `observability.profile_steps` on the chief, and a profiler server
on each task (`observability.profiler_port`) for captures on demand from TensorBoard's Profile tab."""

from __future__ import annotations

import logging

import tensorflow as tf

logger = logging.getLogger(__name__)


class ProfileWindow:
    """Traces global steps [start, stop) into `logdir` (its `plugins/profile/<time>/<host>.xplane.pb`), once."""

    def __init__(self, start: int, stop: int, logdir: str):
        self.start, self.stop, self.logdir = start, stop, logdir
        self.active = False
        self.done = False

    def next_boundary(self, step: int) -> int | None:
        """The next step at which the trace starts or stops, when one is ahead of `step`."""
        for boundary in (self.start, self.stop):
            if not self.done and boundary > step:
                return boundary
        return None

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


def start_profiler_server(port: int | None) -> None:
    """The profiler server TensorBoard's Profile tab captures from (on demand); nothing when `port` is None."""
    if port is None:
        return
    tf.profiler.experimental.server.start(port)
    logger.info("profiler server on port %d (TensorBoard: Profile → Capture profile)", port)
