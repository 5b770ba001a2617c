"""A metrics sink that keeps every value in memory, for tests."""

from __future__ import annotations


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
