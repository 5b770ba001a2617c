"""The conversion's progress reports: rows and source bytes, throttled, ending at 100 % (also on a reuse)."""

from __future__ import annotations

import os

from pipeline_lib.config import DataConfig
from pipeline_lib.core.events import ConversionProgress
from pipeline_lib.data import progress as conversion_progress
from pipeline_lib.data.convert import convert
from tests.pipeline_lib.data.conversion_support import make_rows, write_csv


def test_convert_reports_rows_and_bytes_read_up_to_the_whole_source(tmp_path, monkeypatch):
    monkeypatch.setattr(conversion_progress, "REPORT_INTERVAL_S", 0.0)  # every chunk reports
    source = write_csv(tmp_path / "a.csv", make_rows(300))
    size = os.path.getsize(source)
    reports: list[ConversionProgress] = []
    convert(DataConfig(source=source, label="y", read_chunk_rows=100), str(tmp_path / "out"),
            progress_fn=reports.append)

    assert [r.rows for r in reports] == [100, 200, 300, 300]
    assert [r.done for r in reports] == [False, False, False, True]
    # The CSV's lines are its bytes: the fraction grows with each chunk, to the whole file (header aside).
    fractions = [r.fraction for r in reports]
    assert fractions == sorted(fractions) and 0 < fractions[0] < 0.5 and fractions[-1] == 1.0
    assert reports[2].bytes_read < size == reports[2].total_bytes == reports[-1].bytes_read
    assert "300 rows" in reports[-1].describe() and "MB/s" in reports[-1].describe()

    # An unchanged source reuses its manifest: one report, done, with the manifest's records.
    again: list[ConversionProgress] = []
    convert(DataConfig(source=source, label="y", read_chunk_rows=100), str(tmp_path / "out"), progress_fn=again.append)
    assert [(r.rows, r.done, r.fraction) for r in again] == [(300, True, 1.0)]


def test_reports_are_throttled(tmp_path):
    source = write_csv(tmp_path / "a.csv", make_rows(300))
    reports: list[ConversionProgress] = []
    convert(DataConfig(source=source, label="y", read_chunk_rows=10), str(tmp_path / "out"),
            progress_fn=reports.append)
    # 30 chunks in well under a second: the first report, then the final one.
    assert len(reports) <= 3 and reports[-1].done and reports[-1].rows == 300
