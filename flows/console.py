"""The console of `tfdag run`: the run's events (`pipeline_lib.core.events`) as a live display in a terminal, or as
plain lines when the output is not a terminal (CI, a Prefect worker's log).

In a terminal: the stages as a checklist with their durations, a conversion bar (rows, MB/s), a training bar
(step / total, steps/s, ETA, loss, the latest eval metric), restarts as they happen and a final summary table;
log records below WARNING stay in the Prefect UI and `<run_dir>/logs` instead of scrolling past the display.
Elsewhere the tasks' log lines stay as they were, one line at the end gives the stages' durations, and the
summary is the `tfdag |` lines on stdout.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, TextIO

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from pipeline_lib.core import events
from pipeline_lib.core.events import (
    ConversionProgress,
    Event,
    EventFn,
    Resize,
    Restart,
    RunSummary,
    StageFinished,
    StageStarted,
    TrainProgress,
)

if TYPE_CHECKING:
    from flows.pipeline import PipelineSummary

BAR_WIDTH = 30


def is_terminal(verbose: bool = False) -> bool:
    """Whether `tfdag run` gets the live display: stdout and stderr are terminals, TERM is not dumb, and `-v` (every
    log line) was not asked for."""
    if verbose or os.environ.get("TERM", "") in ("", "dumb"):
        return False
    return sys.stdout.isatty() and sys.stderr.isatty()


def format_seconds(seconds: float) -> str:
    """`4.2 s` under a minute, else `1:02:03` / `2:03`."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class PlainConsole:
    """The events as plain lines, as short as before the console existed: the tasks log their stage's details; at
    the end one line on `err` gives every stage's duration (also after a failure, naming the failed stage), and the
    summary's `tfdag |` lines go to `out`."""

    def __init__(self, out: TextIO | None = None, err: TextIO | None = None):
        self.out, self.err = out, err
        self.stages: list[StageFinished] = []

    def __call__(self, event: Event) -> None:
        if isinstance(event, StageFinished):
            self.stages.append(event)
        elif isinstance(event, RunSummary):
            self.close()
            for line in event.lines:
                self._write(self.out or sys.stdout, line)

    def close(self) -> None:
        """Write the stages' line once (`open_console` closes the console after a failure too)."""
        if not self.stages:
            return
        # Written to the stream, not print(): inside a flow run Prefect's log_prints would turn print into logs.
        self._write(self.err or sys.stderr, "tfdag | stages: " + ", ".join(
            f"{s.name} {'FAILED after ' if s.failed else ''}{format_seconds(s.seconds)}" for s in self.stages))
        self.stages = []

    @staticmethod
    def _write(stream: TextIO, line: str) -> None:
        stream.write(line + "\n")
        stream.flush()


class LiveConsole:
    """The events as a rich live display on `console`; `close()` (or the summary) ends it."""

    def __init__(self, console: Console, *, auto_refresh: bool = True):
        self.console = console
        self.stages: dict[str, tuple[str, float]] = {}  # name -> (state, started or seconds)
        self.conversion: ConversionProgress | None = None
        self.training: TrainProgress | None = None
        self.eval_metrics: dict[str, float] = {}
        self.live = Live(console=console, auto_refresh=auto_refresh, refresh_per_second=4,
                         get_renderable=self.render)  # a library's print goes above the display
        self.live.start()

    def __call__(self, event: Event) -> None:
        if isinstance(event, StageStarted):
            self.stages[event.name] = ("running", time.monotonic())
        elif isinstance(event, StageFinished):
            self.stages[event.name] = ("failed" if event.failed else "done", event.seconds)
        elif isinstance(event, ConversionProgress):
            self.conversion = event
        elif isinstance(event, TrainProgress):
            self.training = event
            self.eval_metrics = event.eval_metrics or self.eval_metrics  # the final report carries none
        elif isinstance(event, Restart):
            self.console.print(Text(f"↻ restart {event.attempt} of {event.max_restarts}: {event.story}",
                                    style="yellow"))
        elif isinstance(event, Resize):
            self.console.print(Text(f"⇅ {event.text}", style="yellow"))
        elif isinstance(event, RunSummary):
            self.close()
            self.console.print(summary_table(event))
            return
        if self.live.is_started:
            self.live.refresh()

    def close(self) -> None:
        if self.live.is_started:
            self.live.refresh()
            self.live.stop()

    def render(self) -> RenderableType:
        parts: list[RenderableType] = [self._checklist()]
        if self.conversion is not None:
            parts.append(conversion_bar(self.conversion))
        if self.training is not None:
            parts.append(training_bar(self.training, self.eval_metrics))
        return Group(*parts)

    def _checklist(self) -> Table:
        table = Table.grid(padding=(0, 1))
        now = time.monotonic()
        for name, (state, value) in self.stages.items():
            mark, style = {"done": ("✔", "green"), "failed": ("✘", "red"), "running": ("…", "cyan")}[state]
            seconds = now - value if state == "running" else value
            table.add_row(Text(mark, style=style), Text(name, style="bold" if state == "running" else ""),
                          Text(format_seconds(seconds), style="dim"))
        return table


def conversion_bar(progress: ConversionProgress) -> Table:
    """`convert  ━━━━━━━━━╸━━━  72%  1,797 rows  2.1 MB/s` (a pulsing bar while the fraction is unknown)."""
    fraction = progress.fraction
    row = Table.grid(padding=(0, 1))
    row.add_row("convert ", ProgressBar(total=1.0, completed=fraction or 0.0, width=BAR_WIDTH, pulse=fraction is None),
                f"{100 * (fraction or 0):3.0f}%", f"{progress.rows:,} rows", f"{progress.mb_per_second:.1f} MB/s")
    return row


def training_bar(progress: TrainProgress, eval_metrics: dict[str, float]) -> Table:
    """`train    ━━━━━━━━━━━━━━  120/170 steps  41.3 steps/s  ETA 1.2 s  loss 0.2011  eval_accuracy 0.9321  eval_loss
    0.2207`: the eval metrics of the chief's latest checkpoint."""
    row = Table.grid(padding=(0, 1))
    cells: list[RenderableType] = [
        "train   ", ProgressBar(total=max(progress.total_steps, 1), completed=progress.step, width=BAR_WIDTH),
        f"{progress.step}/{progress.total_steps} steps"]
    if progress.steps_per_second is not None:
        cells.append(f"{progress.steps_per_second:.1f} steps/s")
    eta = progress.eta_seconds
    if eta is not None and progress.step < progress.total_steps:
        cells.append(f"ETA {format_seconds(eta)}")
    if progress.loss is not None:
        cells.append(f"loss {progress.loss:.4f}")
    cells.extend(f"{name} {value:.4f}" for name, value in sorted(eval_metrics.items()))
    row.add_row(*cells)
    return row


def summary_table(summary: RunSummary) -> Table:
    table = Table(title=summary.title, show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    for label, value in summary.rows:
        table.add_row(label, value)
    return table


def summary_event(summary: PipelineSummary) -> RunSummary:
    """The end of a `tfdag run`: the table's rows and the `tfdag |` lines, from the same values."""
    metrics = ", ".join(f"{k}: {v:.4f}" for k, v in summary.metrics.items())
    blessed = str(summary.blessed).lower()
    trivial = ", ".join(f"{k}: {v:.4f}" for k, v in summary.baseline_metrics.items())
    beside = f" | trivial model ({summary.baseline_model}): {trivial}" if summary.baseline_model else ""
    lines = ["", f"tfdag | {summary.pipeline} | {metrics}{beside}",
             f"tfdag | MLflow run {summary.mlflow_run_id} in experiment {summary.experiment!r} ({summary.mlflow_uri})"]
    final_step = str(summary.final_step) + (f" (stopped early: {summary.stop_reason})" if summary.stopped_early else "")
    rows = [("metrics", metrics)]
    if summary.baseline_model:
        rows.append(("trivial model", f"{trivial} ({summary.baseline_model})"))
    rows += [("final step", final_step),
             ("training", f"{summary.strategy}, {summary.num_workers} worker(s), {summary.num_replicas} replica(s)"),
             ("restarts", "; ".join(summary.restarts) or "none"),
             ("MLflow run", f"{summary.mlflow_run_id} in {summary.experiment!r} ({summary.mlflow_uri})")]
    if summary.mlflow_uri.startswith("sqlite:///"):
        ui = f"mlflow ui --backend-store-uri {summary.mlflow_uri} --host 127.0.0.1 --port 5000"
        lines.append(f"tfdag | open the MLflow UI: {ui}")
        rows.append(("MLflow UI", ui))
    if summary.model_version:
        tag = "" if summary.blessed else ", tagged blessed=false, no alias (tracking.register: always)"
        lines.append(f"tfdag | registered model {summary.model_name} version {summary.model_version}{tag}")
        rows.append(("registered", f"{summary.model_name} version {summary.model_version}{tag}"))
    elif not summary.blessed and summary.mlflow_run_id:
        why = "the model check failed" if summary.model_validated is False else "tracking.register: blessed"
        lines.append(f"tfdag | not registered ({why})")
        rows.append(("registered", f"no ({why})"))
    if summary.model_validated is not None:
        rows.append(("model check", "passed" if summary.model_validated else "FAILED (see blessed)"))
    lines.append(f"tfdag | blessed: {blessed} | {summary.gate.reason}")
    rows.append(("blessed", f"{blessed}: {summary.gate.reason}"))
    return RunSummary(title=f"tfdag run {summary.run_name}", rows=tuple(rows), lines=tuple(lines))


class _HeldBack(logging.Filter):
    """Keeps a console handler quiet while the live display owns the terminal."""

    def filter(self, record: logging.LogRecord) -> bool:
        return False


class _AboveDisplay(logging.Handler):
    """Warnings and errors printed above the live display (the rest is in the Prefect UI and the task logs)."""

    def __init__(self, console: Console):
        super().__init__(level=logging.WARNING)
        self.console = console
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.console.print(Text(self.format(record), style="yellow" if record.levelno < logging.ERROR else "red"))
        except Exception:  # noqa: BLE001 - logging must not raise
            self.handleError(record)


def _terminal_handlers() -> list[logging.Handler]:
    """Every handler that writes to the terminal: a stream handler on stdout or stderr, on any logger."""
    loggers = [logging.getLogger(), *(v for v in logging.Logger.manager.loggerDict.values()
                                      if isinstance(v, logging.Logger))]
    found: dict[int, logging.Handler] = {}
    for logger in loggers:
        for handler in logger.handlers:
            stream = getattr(handler, "stream", None)
            if isinstance(handler, logging.StreamHandler) and stream in (sys.stderr, sys.stdout,
                                                                         sys.__stderr__, sys.__stdout__):
                found[id(handler)] = handler
    return list(found.values())


@contextlib.contextmanager
def open_console(live: bool) -> Iterator[EventFn]:
    """The console for one run, subscribed to the event bus until the block ends; yields it (for the summary).

    Args:
        live: the rich live display (see `is_terminal`), else plain lines.
    """
    if not live:
        plain = PlainConsole()
        try:
            with events.listening(plain):
                yield plain
        finally:
            plain.close()
        return
    handlers = _terminal_handlers()  # before the display replaces sys.stdout and sys.stderr
    console = Console(stderr=True)
    held, above = _HeldBack(), _AboveDisplay(console)
    for handler in handlers:
        handler.addFilter(held)
    logging.getLogger().addHandler(above)
    display = LiveConsole(console)
    try:
        with events.listening(display):
            yield display
    finally:
        display.close()
        logging.getLogger().removeHandler(above)
        for handler in handlers:
            handler.removeFilter(held)
