"""The Parquet reader: whole row groups read ahead or batch by batch give the same shards."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline_lib.config import DataConfig
from pipeline_lib.core import storage
from pipeline_lib.core.errors import is_transient
from pipeline_lib.data.convert import convert
from pipeline_lib.data.errors import ConversionError
from pipeline_lib.data.manifest import MANIFEST_NAME
from pipeline_lib.data.readers import parquet as parquet_reader
from pipeline_lib.data.readers.registry import open_reader
from pipeline_lib.data.sources import list_source
from tests.pipeline_lib.data.conversion_support import read_all


def _row_group_parquet(path, group_sizes: list[int], short_at: int | None = None) -> int:
    """A Parquet file with one row group per entry of group_sizes: a vector `v` of 3 float32 (row i holds
    3i, 3i+1, 3i+2), a string `s` and an int label `y`. `v` is a fixed-size list column, or with `short_at` a
    variable list column whose row short_at (0-based) holds 2 values. Returns the number of rows."""
    v_type = pa.list_(pa.float32()) if short_at is not None else pa.list_(pa.float32(), 3)
    schema = pa.schema([("v", v_type), ("s", pa.string()), ("y", pa.int64())])
    start = 0
    with pq.ParquetWriter(path, schema) as writer:
        for size in group_sizes:
            ids = np.arange(start, start + size)
            values = (ids[:, None] * 3 + np.arange(3)).astype(np.float32)
            if short_at is None:
                v = pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), 3)
            else:
                v = pa.array([row[:2] if i == short_at else row for i, row in zip(ids, values.tolist())], v_type)
            writer.write_table(pa.table({"v": v, "s": [f"s{i}" for i in ids], "y": ids % 3}, schema=schema))
            start += size
    return start


@pytest.mark.parametrize("whole_bytes", ["default", "mixed", "none"])
def test_parquet_row_groups_read_whole_ahead_or_batch_by_batch_give_the_same_shards(tmp_path, monkeypatch,
                                                                                     whole_bytes):
    """Row groups small enough are decoded whole (the next one on a helper thread), larger ones batch by batch:
    either way every row arrives once, in file order, so the shards are byte-identical to a batch-wise read."""
    sizes = [70, 5, 130, 1, 64, 33]
    source = tmp_path / "g.parquet"
    total = _row_group_parquet(source, sizes)
    data = DataConfig(source=str(source), label="y", read_chunk_rows=32, target_shard_mb=0.002)

    default_limit = parquet_reader._WHOLE_ROW_GROUP_BYTES
    monkeypatch.setattr(parquet_reader, "_WHOLE_ROW_GROUP_BYTES", 0)  # the reference: every group batch by batch
    reference = convert(data, str(tmp_path / "reference"))

    meta = pq.ParquetFile(source).metadata
    group_bytes = [sum(meta.row_group(g).column(c).total_uncompressed_size for c in range(meta.num_columns))
                   for g in range(meta.num_row_groups)]
    limit = {"default": default_limit,
             "mixed": sorted(group_bytes)[len(group_bytes) // 2], "none": 0}[whole_bytes]
    monkeypatch.setattr(parquet_reader, "_WHOLE_ROW_GROUP_BYTES", limit)
    calls = {"whole": 0, "batches": 0}
    real_read, real_iter = pq.ParquetFile.read_row_group, pq.ParquetFile.iter_batches

    def read_row_group(self, *args, **kwargs):
        calls["whole"] += 1
        return real_read(self, *args, **kwargs)

    def iter_batches(self, *args, **kwargs):
        calls["batches"] += 1
        return real_iter(self, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", read_row_group)
    monkeypatch.setattr(pq.ParquetFile, "iter_batches", iter_batches)
    manifest = convert(data, str(tmp_path / whole_bytes))
    whole = sum(size <= limit for size in group_bytes)
    assert calls == {"whole": whole, "batches": len(sizes) - whole}
    if whole_bytes == "mixed":
        assert 0 < whole < len(sizes)
    assert [(s.split, s.num_records, s.digest) for s in manifest.shards] == \
        [(s.split, s.num_records, s.digest) for s in reference.shards]
    assert len(manifest.shards) > 2
    parsed = read_all(manifest)
    ids = parsed["v"][:, 0].astype(np.int64) // 3
    assert sorted(ids.tolist()) == list(range(total))
    np.testing.assert_array_equal(parsed["v"], (ids[:, None] * 3 + np.arange(3)).astype(np.float32))
    assert [s.decode() for s in parsed["s"]] == [f"s{i}" for i in ids]


@pytest.mark.parametrize("whole_bytes", [128 << 20, 0])
def test_a_bad_parquet_row_past_the_first_groups_is_named_by_its_row_and_stops_the_decoder(tmp_path, monkeypatch,
                                                                                          whole_bytes):
    import threading

    monkeypatch.setattr(parquet_reader, "_WHOLE_ROW_GROUP_BYTES", whole_bytes)
    source = tmp_path / "bad.parquet"
    _row_group_parquet(source, [40, 40, 40, 40, 40], short_at=97)  # 0-based row 97 is row 98 of the file
    with pytest.raises(ConversionError) as error:
        convert(DataConfig(source=str(source), label="y", read_chunk_rows=16), str(tmp_path / "out"))
    assert "bad.parquet row 98" in str(error.value) and "column 'v'" in str(error.value)
    assert "length 3" in str(error.value)
    assert not [t.name for t in threading.enumerate() if t.name.startswith(("tfdag-parquet", "tfdag-read"))]
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").rglob(MANIFEST_NAME))
    skipped = convert(DataConfig(source=str(source), label="y", read_chunk_rows=16, on_bad_record="skip"),
                      str(tmp_path / "skip"))
    assert skipped.num_bad_records == 1
    assert skipped.num_records("train") + skipped.num_records("eval") == 199


def test_an_outage_while_reading_the_footer_is_storage_unavailable_not_a_conversion_error(tmp_path, monkeypatch):
    """pyarrow raises several types for a file that is not Parquet; a dropped connection is not one of those."""
    source = tmp_path / "t.parquet"
    _row_group_parquet(source, [10])
    data = DataConfig(source=str(source), label="y")
    fs, files = list_source(data)

    class _Dropping:
        def __init__(self, handle):
            self._handle = handle

        def __getattr__(self, name):
            return getattr(self._handle, name)

        def read(self, *args):
            raise ConnectionResetError(104, "Connection reset by peer")

    real_open = fs.open
    monkeypatch.setattr(fs, "open", lambda path, mode="rb", **kw: _Dropping(real_open(path, mode, **kw)))
    with pytest.raises(storage.StorageUnavailable) as caught:
        open_reader(fs, files[0], data)
    assert "t.parquet" in str(caught.value) and is_transient(caught.value)
    assert not isinstance(caught.value, ConversionError)
