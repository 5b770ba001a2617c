"""Calendar parts of date and timestamp features inside the model, by integer TensorFlow ops on their instants.

A timestamp feature holds int64 microseconds since 1970-01-01 UTC, a date feature int64 days since then
(`FeatureSpec.time`); MISSING_INT64 is a missing one. The model takes a fixed set of parts of each, in UTC:
the year, the month, the day of the week and, for timestamps, the hour. The set is fixed by the column's type,
never picked from the values (a file sorted by time shows no variation in its first chunk). The year is a
number (z-scored with the train split's statistics of the instant); the others are one-hot vectors of fixed
width, all zero for a missing instant, whose year is imputed like any number's.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import tensorflow as tf

from pipeline_lib.data.manifest import TimeKind
from pipeline_lib.data.statistics import MISSING_INT64

MICROS_PER_DAY = 86_400_000_000
MICROS_PER_HOUR = 3_600_000_000
DAYS_PER_YEAR = 365.2425  # the Gregorian calendar's mean year
# The one-hot parts of each kind, with their widths: months 1..12, days of the week Monday (0)..Sunday (6),
# hours 0..23. The year comes first, as a number.
ONE_HOT_PARTS = {
    TimeKind.TIMESTAMP: (("month", 12), ("day_of_week", 7), ("hour", 24)),
    TimeKind.DATE: (("month", 12), ("day_of_week", 7)),
}


def days_since_epoch(instants: tf.Tensor, kind: TimeKind | str) -> tf.Tensor:
    """Whole days since 1970-01-01 UTC of int64 instants (floored: an instant before 1970 on its own day)."""
    instants = tf.convert_to_tensor(instants, tf.int64)
    return tf.math.floordiv(instants, MICROS_PER_DAY) if TimeKind(kind) == TimeKind.TIMESTAMP else instants


def civil_from_days(days: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """(year, month 1..12, day 1..31) of the proleptic Gregorian date `days` after 1970-01-01, by integer ops.

    Howard Hinnant's `civil_from_days` (http://howardhinnant.github.io/date_algorithms.html): the calendar shifted
    to start on March 1 so that the leap day ends each 400-year era; exact for every int64 day within ±2^62.
    """
    z = tf.convert_to_tensor(days, tf.int64) + 719_468
    era = tf.math.floordiv(z, 146_097)
    day_of_era = z - era * 146_097  # [0, 146096]
    year_of_era = (day_of_era - day_of_era // 1_460 + day_of_era // 36_524 - day_of_era // 146_096) // 365  # [0, 399]
    day_of_year = day_of_era - (365 * year_of_era + year_of_era // 4 - year_of_era // 100)  # [0, 365], from March 1
    shifted_month = (5 * day_of_year + 2) // 153  # [0, 11], March first
    day = day_of_year - (153 * shifted_month + 2) // 5 + 1
    month = tf.where(shifted_month < 10, shifted_month + 3, shifted_month - 9)
    year = year_of_era + era * 400 + tf.cast(month <= 2, tf.int64)
    return year, month, day


def calendar_parts(instants: tf.Tensor, kind: TimeKind | str) -> dict[str, tf.Tensor]:
    """The calendar parts of int64 instants, in UTC: `year`, `month` (1..12), `day_of_week` (0 Monday .. 6
    Sunday, as Python's `date.weekday()`) and, for timestamps, `hour` (0..23). A missing instant gives
    meaningless parts: mask it first."""
    kind = TimeKind(kind)
    instants = tf.convert_to_tensor(instants, tf.int64)
    days = days_since_epoch(instants, kind)
    year, month, _day = civil_from_days(days)
    # 1970-01-01 was a Thursday (3, counting from Monday); floormod keeps days before 1970 in 0..6.
    parts = {"year": year, "month": month, "day_of_week": tf.math.floormod(days + 3, 7)}
    if kind == TimeKind.TIMESTAMP:
        parts["hour"] = tf.math.floordiv(tf.math.floormod(instants, MICROS_PER_DAY), MICROS_PER_HOUR)
    return parts


def year_of(instant: float, kind: TimeKind | str) -> float:
    """The (fractional) year of an instant, by the mean Gregorian year: for constants built from statistics."""
    days = instant / MICROS_PER_DAY if TimeKind(kind) == TimeKind.TIMESTAMP else instant
    return 1970.0 + days / DAYS_PER_YEAR


def width(kind: TimeKind | str, indicator: bool = False) -> int:
    """Columns of `CalendarFeatures`' output: the year, each one-hot part's width, the missing indicator."""
    return 1 + sum(size for _name, size in ONE_HOT_PARTS[TimeKind(kind)]) + int(indicator)


@keras.saving.register_keras_serializable(package="tfdag")
class CalendarFeatures(keras.layers.Layer):
    """int64 instants `[batch, 1]` to float32 `[batch, width(kind, indicator)]`: the year, imputed with
    `year_fill` where the instant is missing and then `(year - year_mean) / year_std`; the one-hot month, day of
    the week and (timestamps) hour, all zero where missing; and, with `indicator`, 1.0 where missing.
    """

    def __init__(self, kind: str, year_fill: float = 1970.0, year_mean: float = 0.0, year_std: float = 1.0,
                 indicator: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.kind = TimeKind(kind).value
        self.year_fill, self.year_mean, self.year_std = float(year_fill), float(year_mean), float(year_std)
        self.indicator = bool(indicator)

    def call(self, x):
        instants = tf.reshape(tf.cast(x, tf.int64), [-1])
        missing = tf.equal(instants, MISSING_INT64)
        parts = calendar_parts(tf.where(missing, tf.zeros_like(instants), instants), self.kind)
        year = tf.where(missing, tf.constant(self.year_fill, tf.float32), tf.cast(parts["year"], tf.float32))
        present = tf.cast(tf.logical_not(missing), tf.float32)[:, None]
        columns = [((year - self.year_mean) / self.year_std)[:, None]]
        for name, size in ONE_HOT_PARTS[TimeKind(self.kind)]:
            first = 1 if name == "month" else 0
            columns.append(tf.one_hot(parts[name] - first, size, dtype=tf.float32) * present)
        if self.indicator:
            columns.append(1.0 - present)
        return tf.concat(columns, axis=1)

    def compute_output_shape(self, input_shape):
        return (input_shape[0], width(self.kind, self.indicator))

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "kind": self.kind, "year_fill": self.year_fill, "year_mean": self.year_mean,
                "year_std": self.year_std, "indicator": self.indicator}


def year_constants(kind: TimeKind | str, mean: float | None, variance: float | None,
                   fill: float | None) -> tuple[float, float, float]:
    """(year_fill, year_mean, year_std) of `CalendarFeatures` from the train statistics of the instant: its mean
    and variance (None: no values), and the imputation's fill instant (None: the mean). The standard deviation
    is at least one year, so data of a few months does not blow up a later year's z-score."""
    if mean is None:
        return (year_of(fill, kind) if fill is not None else 1970.0), 1970.0, 1.0
    per_year = DAYS_PER_YEAR * (MICROS_PER_DAY if TimeKind(kind) == TimeKind.TIMESTAMP else 1)
    std = max(float(np.sqrt(variance or 0.0)) / per_year, 1.0)
    return year_of(fill if fill is not None else mean, kind), year_of(mean, kind), std
