"""The small interfaces the training loop calls out through: a metrics sink and step hooks."""

from __future__ import annotations

from typing import Protocol


class MetricsSink(Protocol):
    """Where the chief logs metrics: `log_metrics` buffers or sends one step's values, `flush` sends the rest."""

    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...

    def flush(self) -> None: ...


class NullSink:
    """Discards everything: what non-chief workers get."""

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        pass

    def flush(self) -> None:
        pass


class TrainHooks:
    """Callbacks the loop calls at step boundaries; the defaults do nothing.

    `on_step_end(step, examples, loss)` gets the global step just finished, the examples of that
    step over all replicas, and its loss. `stop_requested()` is polled between executions; when
    it returns True (on any worker) the loop saves a checkpoint and raises TrainingInterrupted.
    """

    def on_step_end(self, step: int, examples: int, loss: float) -> None:
        pass

    def stop_requested(self) -> bool:
        return False
