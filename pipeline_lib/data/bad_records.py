"""Bad records: fail on the first one in file order, or count them and keep a few messages that name them."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline_lib.config import OnBadRecord
from pipeline_lib.data.coercion import Column
from pipeline_lib.data.errors import ConversionError
from pipeline_lib.data.readers.base import RawChunk

logger = logging.getLogger(__name__)

MAX_BAD_SAMPLES = 5


def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def bad_message(chunk: RawChunk, position: int, column: str | None, value: Any, why: str) -> str:
    """`<file> line|row <n>, column '<name>': value <value> <why>` (without a column: `<file> line <n> <why>`)."""
    where = f"{chunk.uri} {chunk.unit} {position}"
    if column is None:
        return f"{where} {why}"
    return f"{where}, column {column!r}: value {_describe(value)} {why}"


@dataclass
class BadRecords:
    """The bad rows skipped so far, and messages for the first MAX_BAD_SAMPLES of them."""

    on_bad_record: OnBadRecord
    num_bad: int = 0
    samples: list[str] = field(default_factory=list)

    def handle(self, chunk: RawChunk, columns: dict[str, Column], bad: np.ndarray,
               fail: np.ndarray | None = None, skip: np.ndarray | None = None) -> None:
        """Fail on the first bad row of `chunk` in file order, or count and sample its bad rows.

        Args:
            chunk: the chunk read; its `structural` rows could not be split into columns.
            columns: the chunk's coerced columns, with each bad value's reason.
            bad: per row, whether any column of it was bad.
            fail: rows that fail whatever `on_bad_record` says (a missing value under `data.missing: fail`).
            skip: rows skipped whatever `on_bad_record` says: bad only for missing values under
                `data.missing: skip`.

        Raises:
            ConversionError: with `on_bad_record: fail`, naming the file, line or row, column and value.
        """
        problems: list[tuple[int, str]] = []
        for position, why in chunk.structural:
            problems.append((position, bad_message(chunk, position, None, None, why)))
        rows = np.flatnonzero(bad)
        if self.on_bad_record == OnBadRecord.FAIL:
            failing = bad & ~skip if skip is not None else bad
        else:
            failing = fail if fail is not None else np.zeros_like(bad)
        fail = bool(chunk.structural and self.on_bad_record == OnBadRecord.FAIL) or bool(failing.any())
        if fail:
            rows = np.flatnonzero(failing)
            if self.on_bad_record != OnBadRecord.FAIL:
                problems = []
        limit = 1 if fail else max(0, MAX_BAD_SAMPLES - len(self.samples))
        for row in rows[: max(limit, 1)].tolist():
            name = next(n for n, c in columns.items() if c.bad[row])
            value, why = columns[name].reasons[row]
            position = chunk.position(row)
            problems.append((position, bad_message(chunk, position, name, value, why)))
        problems.sort(key=lambda p: p[0])
        if fail:
            _position, message = problems[0]
            if message.endswith(" is missing"):
                fix = ("fill it in, or set data.missing (or data.missing_columns.<column>.missing) to impute or "
                       "skip; a missing label is a bad record: data.on_bad_record: skip drops such rows")
            else:
                fix = ("fix the source or set data.on_bad_record: skip to drop such rows (they are counted in the "
                       "manifest)")
            raise ConversionError(f"bad record: {message}; {fix}")
        count = len(chunk.structural) + len(rows)
        self.num_bad += count
        for _position, message in problems:
            if len(self.samples) < MAX_BAD_SAMPLES:
                self.samples.append(message)
                logger.warning("convert | skipping bad record: %s", message)
        logger.info("convert | skipped %d bad record(s) in %s (%d so far)", count, chunk.uri, self.num_bad)

