"""The conversion's progress reports: rows converted and source bytes read, at most once a second, to a callback."""

from __future__ import annotations

import time
from collections.abc import Callable

from pipeline_lib.core.events import ConversionProgress, Throttle

ProgressFn = Callable[[ConversionProgress], None]
REPORT_INTERVAL_S = 1.0  # one report a second costs nothing beside chunks of thousands of rows


class ConversionMeter:
    """Counts what `convert` has done and reports it to `progress_fn` (throttled; the last report always goes).

    Bytes are whole source files done plus the current file's bytes its reader reports per chunk (uncompressed
    CSV and JSONL), capped at the file's size.
    """

    def __init__(self, progress_fn: ProgressFn | None, total_bytes: int, interval_s: float | None = None):
        self.progress_fn = progress_fn
        self.total_bytes = total_bytes
        self.rows = 0
        self._files_bytes = 0  # bytes of the files done
        self._file_bytes = 0  # bytes read of the current file
        self._throttle = Throttle(REPORT_INTERVAL_S if interval_s is None else interval_s)
        self._started = time.monotonic()

    def chunk_done(self, num_rows: int, num_bytes: int | None, file_size: int) -> None:
        """A chunk of `num_rows` rows (kept or not) from the current file is converted."""
        self.rows += num_rows
        if num_bytes is not None:
            self._file_bytes = min(self._file_bytes + num_bytes, file_size)
        if self.progress_fn is not None and self._throttle.ready():
            self.progress_fn(self._progress(done=False))

    def file_done(self, file_size: int) -> None:
        self._files_bytes += file_size
        self._file_bytes = 0

    def finish(self, rows: int | None = None) -> None:
        """The conversion is complete (or reused, with its manifest's `rows`): the final report, at 100 %."""
        if rows is not None:
            self.rows = rows
        if self.progress_fn is not None:
            self.progress_fn(self._progress(done=True))

    def _progress(self, *, done: bool) -> ConversionProgress:
        read = self.total_bytes if done else self._files_bytes + self._file_bytes
        return ConversionProgress(rows=self.rows, bytes_read=read, total_bytes=self.total_bytes,
                                  seconds=time.monotonic() - self._started, done=done)
