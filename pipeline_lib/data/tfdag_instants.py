"""Dates and times as int64 instants: the one rule conversion and scoring share, with nothing of tfdag imported.

A timestamp is microseconds since 1970-01-01 UTC, a date days since then. Conversion reads the ISO 8601 strings of
`data.parse_dates` with `instant_of`, and so does the scoring of a served model, so a string scores as the instant
it was trained as. Like `serving.tfdag_scoring`, this module imports only the standard library, numpy and pandas:
it ships beside `tfdag_scoring.py` in every logged MLflow model (`code_paths`), as the top-level module
`tfdag_instants`.
"""

from __future__ import annotations

import datetime
from typing import Any

import numpy as np
import pandas as pd

MISSING_INSTANT = -(1 << 63)  # a missing date or timestamp: conversion's MISSING_INT64
MICROS_PER_DAY = 86_400_000_000
_EPOCH = datetime.datetime(1970, 1, 1)
_EPOCH_ORDINAL = _EPOCH.toordinal()
_INT64_RANGE = (MISSING_INSTANT + 1, (1 << 63) - 1)  # -2**63 itself is the missing value


def is_missing(cell: Any) -> bool:
    """Whether a table cell is missing: None, pandas' NA, or a scalar NaN or NaT (a list never is)."""
    if cell is None or cell is pd.NA:
        return True
    try:
        return bool(np.ndim(cell) == 0 and pd.isna(cell))
    except (TypeError, ValueError):
        return False


def instant_of(value: Any, kind: str) -> int | None:
    """The int64 instant of one value: microseconds since 1970-01-01 UTC for `kind` "timestamp", days since
    then for "date" (a timestamp's UTC day); None for a missing value (None, NaN, NaT, an empty string).

    Takes a datetime (naive: read as UTC; aware: converted to UTC; also pandas' Timestamp and numpy's
    datetime64, floored to the microsecond), a date (midnight UTC), or an ISO 8601 string as Python's
    `datetime.fromisoformat` reads it: "2024-05-01", "2024-05-01 13:45", "2024-05-01T13:45:00.5+02:00", "…Z".

    Raises:
        ValueError: for anything else (a number, text that is not ISO 8601), or an instant beyond int64.
    """
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    if isinstance(value, str):
        if not value:
            return None
        try:
            value = datetime.datetime.fromisoformat(value)
        except ValueError:
            raise ValueError("is not an ISO 8601 date or timestamp") from None
    if is_missing(value):
        return None
    if isinstance(value, pd.Timestamp | np.datetime64):
        stamp = pd.Timestamp(value)
        if stamp.tzinfo is not None:
            stamp = stamp.tz_convert("UTC").tz_localize(None)
        micros = int(stamp.to_datetime64().astype("datetime64[us]").astype(np.int64))
    elif isinstance(value, datetime.datetime):
        if value.tzinfo is not None:
            value = value.astimezone(datetime.UTC).replace(tzinfo=None)
        micros = (value - _EPOCH) // datetime.timedelta(microseconds=1)
    elif isinstance(value, datetime.date):
        micros = (value.toordinal() - _EPOCH_ORDINAL) * MICROS_PER_DAY
    else:  # a bad value of its row, as unparseable text is: the callers report both alike
        raise ValueError("is not a date or timestamp")  # noqa: TRY004
    instant = micros // MICROS_PER_DAY if kind == "date" else micros
    if not _INT64_RANGE[0] <= instant <= _INT64_RANGE[1]:
        raise ValueError("is beyond the int64 range of microseconds since 1970")
    return instant
