"""The progress events of a run (stages, conversion, training, restarts, the summary) and the in-process bus that
carries them to whoever displays them (the `tfdag run` console, a Prefect progress artifact).

The library reports through plain callbacks (`convert(..., progress_fn=...)`, a launcher's `on_progress`); the
layer that owns the display decides where the events go. `tfdag run` runs its flow in its own process, so the
CLI subscribes its console with `listening(fn)` and the tasks `emit` to it; without a listener `emit` does nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator

logger = logging.getLogger(__name__)

MB = 1024 * 1024


@dataclasses.dataclass(frozen=True)
class StageStarted:
    """A stage of the pipeline started (`convert_to_tfrecords`, `train`...)."""

    name: str


@dataclasses.dataclass(frozen=True)
class StageFinished:
    """A stage ended after `seconds`; `failed` when it raised."""

    name: str
    seconds: float
    failed: bool = False


@dataclasses.dataclass(frozen=True)
class ConversionProgress:
    """How far the conversion is: rows converted, source bytes read of the source's total, seconds so far.

    `bytes_read` counts whole files done plus, for uncompressed CSV and JSONL, the lines read of the current file
    (Parquet and NPZ count when their file is done), so the fraction is exact at file boundaries and at the end.
    """

    rows: int
    bytes_read: int
    total_bytes: int
    seconds: float
    done: bool = False

    @property
    def fraction(self) -> float | None:
        """Done fraction of the source bytes (1.0 once done), None for an empty listing."""
        if self.done:
            return 1.0
        return min(self.bytes_read / self.total_bytes, 1.0) if self.total_bytes > 0 else None

    @property
    def mb_per_second(self) -> float:
        return self.bytes_read / MB / self.seconds if self.seconds > 0 else 0.0

    @property
    def rows_per_second(self) -> float:
        return self.rows / self.seconds if self.seconds > 0 else 0.0

    def describe(self) -> str:
        """`1,797 rows | 0.3 of 0.3 MB | 2.1 MB/s`: one line for a log or an artifact's description."""
        return (f"{self.rows:,} rows | {self.bytes_read / MB:.1f} of {self.total_bytes / MB:.1f} MB | "
                f"{self.mb_per_second:.1f} MB/s")


@dataclasses.dataclass(frozen=True)
class TrainProgress:
    """How far training is, from the chief's heartbeat: for a progress display.

    `eval_metrics` are the eval metrics of the chief's latest checkpoint (empty before the first one).
    """

    step: int
    total_steps: int
    loss: float | None
    examples_per_second: float | None
    steps_per_second: float | None = None
    eval_metrics: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def eta_seconds(self) -> float | None:
        """Seconds to the last step at the current step rate; None before a rate is known."""
        if not self.steps_per_second:
            return None
        return max(self.total_steps - self.step, 0) / self.steps_per_second

    def describe(self) -> str:
        """`step 120 of 170 | loss 0.2011 | 1,510 examples/s | eval_accuracy 0.9321`."""
        parts = [f"step {self.step} of {self.total_steps}"]
        if self.loss is not None:
            parts.append(f"loss {self.loss:.4f}")
        if self.examples_per_second is not None:
            parts.append(f"{self.examples_per_second:,.0f} examples/s")
        parts.extend(f"{name} {value:.4f}" for name, value in self.eval_metrics.items())
        return " | ".join(parts)


@dataclasses.dataclass(frozen=True)
class Restart:
    """The supervisor restarted training: attempt `attempt` of `max_restarts`, with its cause and resume step."""

    attempt: int
    max_restarts: int
    story: str


@dataclasses.dataclass(frozen=True)
class Resize:
    """An elastic run's group was resized: `text` says from and to how many workers, at which step and why."""

    text: str


@dataclasses.dataclass(frozen=True)
class RunSummary:
    """The end of a run: a title and (label, value) rows for a table, and the same as plain `lines`."""

    title: str
    rows: tuple[tuple[str, str], ...]
    lines: tuple[str, ...] = ()


Event = StageStarted | StageFinished | ConversionProgress | TrainProgress | Restart | Resize | RunSummary
EventFn = Callable[[Event], None]

_listeners: list[EventFn] = []
_lock = threading.Lock()


@contextlib.contextmanager
def listening(fn: EventFn) -> Iterator[None]:
    """Send every event emitted in this process to `fn` until the block ends."""
    with _lock:
        _listeners.append(fn)
    try:
        yield
    finally:
        with _lock:
            _listeners.remove(fn)


def emit(event: Event) -> None:
    """Give `event` to every listener; a listener that fails is logged at debug level (a display must never stop
    the run)."""
    with _lock:
        listeners = list(_listeners)
    for fn in listeners:
        try:
            fn(event)
        except Exception:
            logger.debug("event listener failed on %r", event, exc_info=True)


class Throttle:
    """True at most once every `interval_s` (the first call passes): keeps progress reports off the hot path."""

    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        self._last = float("-inf")

    def ready(self) -> bool:
        now = time.monotonic()
        if now - self._last < self.interval_s:
            return False
        self._last = now
        return True
