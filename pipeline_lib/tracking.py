"""Metrics sinks: a tiny interface the training loop logs through (MLflow, in-memory, no-op)."""

from __future__ import annotations

from typing import Protocol


class MetricsSink(Protocol):
    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...

    def flush(self) -> None: ...


class NullSink:
    """Discards everything: what non-chief workers get."""

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        pass

    def flush(self) -> None:
        pass


class InMemorySink:
    """Keeps every logged value, for tests."""

    def __init__(self) -> None:
        self.history: list[tuple[int, dict[str, float]]] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.history.append((step, dict(metrics)))

    def flush(self) -> None:
        pass

    def series(self, name: str) -> list[tuple[int, float]]:
        return [(step, values[name]) for step, values in self.history if name in values]
