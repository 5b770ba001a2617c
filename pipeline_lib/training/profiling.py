"""TensorBoard's profiler server on each task (`observability.profiler_port`), for captures on demand from
TensorBoard's Profile tab; the chief's trace of `observability.profile_steps` is a loop action
(`actions.profiling.ProfileWindow`)."""

from __future__ import annotations

import logging

import tensorflow as tf

logger = logging.getLogger(__name__)


def start_profiler_server(port: int | None) -> None:
    """The profiler server TensorBoard's Profile tab captures from (on demand); nothing when `port` is None."""
    if port is None:
        return
    tf.profiler.experimental.server.start(port)
    logger.info("profiler server on port %d (TensorBoard: Profile → Capture profile)", port)
