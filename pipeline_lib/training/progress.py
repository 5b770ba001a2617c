"""The chief's progress reporting: the greppable progress line, TensorBoard scalars and metrics-sink values."""

from __future__ import annotations

import logging
import math
import time

import numpy as np
import tensorflow as tf

from pipeline_lib.training.hooks import Execution, MetricsSink

logger = logging.getLogger(__name__)


def current_learning_rate(optimizer) -> float:
    """The optimizer's learning rate now (NaN when it cannot be read as a number)."""
    try:
        return float(np.asarray(optimizer.learning_rate))
    except (TypeError, ValueError):
        return float("nan")


class ProgressLogger:
    """The chief's progress line, TensorBoard scalars and sink metrics at each logged step.

    Besides the loss, learning rate and examples/s, each logged step writes the means over the steps since the
    previous one of `step_seconds` (execution wall time per step, input included), `input_wait_seconds` and
    `gradient_norm` (see `training.step.StepOutputs`). Every worker keeps the throughput count; only the chief
    writes.
    """

    def __init__(self, is_chief: bool, tensorboard_dir: str, sink: MetricsSink, global_batch: int, step: int):
        self.is_chief = is_chief
        self.sink = sink
        self.global_batch = global_batch
        self.writer = tf.summary.create_file_writer(tensorboard_dir) if is_chief else None
        self.last_step = step
        self.last_time = time.perf_counter()
        self.total_steps = 0
        self.total_time = 0.0
        self._interval: list[Execution] = []  # the executions since the last logged step

    def record(self, execution: Execution) -> None:
        """Note an execution; the next `log` writes the means over the executions noted since the previous one."""
        if self.is_chief:
            self._interval.append(execution)

    def _interval_means(self) -> dict[str, float]:
        executions, self._interval = self._interval, []
        steps = sum(e.steps for e in executions)
        if not steps:
            return {}
        means = {"step_seconds": math.fsum(e.seconds for e in executions) / steps}
        for name, values in (("input_wait_seconds", [w for e in executions for w in e.input_waits_s]),
                             ("gradient_norm", [n for e in executions for n in e.gradient_norms])):
            if values:
                means[name] = math.fsum(values) / len(values)
        return means

    def log(self, step: int, loss: float, learning_rate: float) -> None:
        """Log the training loss, learning rate and throughput since the previous call, and the means of what the
        executions recorded since then measured."""
        now = time.perf_counter()
        elapsed = max(now - self.last_time, 1e-9)
        steps = step - self.last_step
        self.total_steps += steps
        self.total_time += elapsed
        self.last_step, self.last_time = step, now
        if not self.is_chief:
            return
        steps_per_sec = steps / elapsed
        examples_per_sec = steps_per_sec * self.global_batch
        logger.info("train | step: %6d | steps/sec: %.1f | examples/sec: %.0f | loss: %.4f",
                    step, steps_per_sec, examples_per_sec, loss)
        means = self._interval_means()
        with self.writer.as_default(step=step):
            tf.summary.scalar("loss", loss)
            tf.summary.scalar("learning_rate", learning_rate)
            tf.summary.scalar("examples_per_sec", examples_per_sec)
            for name, value in means.items():
                tf.summary.scalar(name, value)
        self.sink.log_metrics({"loss": loss, "learning_rate": learning_rate, "steps_per_sec": steps_per_sec,
                               "examples_per_sec": examples_per_sec, **means}, step=step)

    def log_eval(self, step: int, metrics: dict[str, float]) -> None:
        """Log the eval metrics measured at a checkpoint."""
        if not self.is_chief or not metrics:
            return
        with self.writer.as_default(step=step):
            for name, value in metrics.items():
                tf.summary.scalar(name, value)
        self.sink.log_metrics(metrics, step=step)

    def flush_summaries(self) -> None:
        """Write the buffered TensorBoard events to their files (before they are uploaded)."""
        if self.writer is not None:
            self.writer.flush()

    @property
    def examples_per_sec(self) -> float:
        return self.total_steps * self.global_batch / self.total_time if self.total_time else 0.0

    def close(self) -> None:
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
        self.sink.flush()
