"""Tests for how the Ray engine splits a source into tasks (`ray_engine.work_units`) and for reading a run of a
Parquet file's row groups; no Ray cluster: tests/ray/test_ray_convert.py runs the tasks."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline_lib.config import DataConfig
from pipeline_lib.data.chunk_conversion import plan_conversion
from pipeline_lib.data.ray_engine import work_units
from pipeline_lib.data.sources import list_source


def _parquet(path, rows: int, row_group_size: int) -> None:
    table = pa.table({"x": np.arange(rows, dtype=np.float32), "y": np.arange(rows) % 3})
    pq.write_table(table, path, row_group_size=row_group_size)


def test_a_large_parquet_file_splits_by_row_groups_and_its_rows_keep_their_numbers(tmp_path):
    (tmp_path / "src").mkdir()
    _parquet(tmp_path / "src" / "a.parquet", 1000, 100)  # 10 row groups
    _parquet(tmp_path / "src" / "b.parquet", 50, 100)  # 1 row group: one unit
    data = DataConfig(source=str(tmp_path / "src" / "*.parquet"), label="y", read_chunk_rows=64)
    fs, files = list_source(data)
    metadata = pq.ParquetFile(files[0].path).metadata
    smallest = min(metadata.row_group(g).total_byte_size for g in range(metadata.num_row_groups))
    units = work_units(fs, files, unit_bytes=3 * smallest - 1)
    assert [(u.file.uri.rsplit("/", 1)[-1], u.row_groups) for u in units] == [
        ("a.parquet", range(3)), ("a.parquet", range(3, 6)), ("a.parquet", range(6, 9)),
        ("a.parquet", range(9, 10)), ("b.parquet", None)]
    assert [u.index for u in units] == list(range(5))
    assert sum(u.num_bytes for u in units[:4]) <= files[0].info.size

    plan, first = plan_conversion(fs, files, data)
    first.close()
    seen, positions = [], []
    for unit in units[:4]:
        for chunk in plan.chunks(fs, unit.file, data, unit.row_groups):
            seen += chunk.columns["x"].to_pylist()
            positions += [chunk.position(i) for i in range(chunk.num_rows)]
    assert seen == list(range(1000)) and positions == list(range(1, 1001))

    assert [u.row_groups for u in work_units(fs, files)] == [None, None]  # small files: one task each
