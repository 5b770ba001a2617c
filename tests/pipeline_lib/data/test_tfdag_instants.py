"""The int64 instants of dates and timestamps (`tfdag_instants`): every form a value may take, in UTC, floored to
the microsecond; the missing value is conversion's."""

from __future__ import annotations

import datetime

import numpy as np
import pandas as pd
import pytest

from pipeline_lib.data.statistics import MISSING_INT64
from pipeline_lib.data.tfdag_instants import MICROS_PER_DAY, MISSING_INSTANT, instant_of


def test_the_missing_instant_is_conversions_missing_int64():
    assert MISSING_INSTANT == MISSING_INT64  # tfdag_instants imports nothing of tfdag, so it has its own copy


def test_instant_of_reads_every_form_of_a_date_or_a_time_in_utc():
    noon = 1_709_208_000_000_000 + 123_456  # 2024-02-29T12:00:00.123456Z
    aware = datetime.datetime(2024, 2, 29, 13, 0, 0, 123_456, tzinfo=datetime.timezone(datetime.timedelta(hours=1)))
    for value in ("2024-02-29T12:00:00.123456Z", "2024-02-29 13:00:00.123456+01:00", b"2024-02-29T12:00:00.123456",
                  datetime.datetime(2024, 2, 29, 12, 0, 0, 123_456), aware, pd.Timestamp(aware),
                  pd.Timestamp("2024-02-29T12:00:00.123456789"), np.datetime64("2024-02-29T12:00:00.123456789")):
        assert instant_of(value, "timestamp") == noon, value
        assert instant_of(value, "date") == noon // MICROS_PER_DAY, value
    assert instant_of(datetime.date(1969, 12, 31), "date") == -1
    assert instant_of("1969-12-31", "timestamp") == -MICROS_PER_DAY
    assert instant_of(np.datetime64(-1, "ns"), "timestamp") == -1  # floored to the microsecond, as conversion does
    for missing in (None, float("nan"), pd.NaT, np.datetime64("NaT"), ""):
        assert instant_of(missing, "timestamp") is None
    for bad in ("yesterday", "2024-13-01", 1_700_000_000, True, 1.5):
        with pytest.raises(ValueError):
            instant_of(bad, "timestamp")
