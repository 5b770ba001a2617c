"""The Parquet reader: record batches of the needed columns, whole row groups decoded one group ahead."""

from __future__ import annotations

import concurrent.futures
import contextlib
from collections.abc import Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline_lib.config import DataConfig
from pipeline_lib.data.errors import ConversionError, raise_if_outage
from pipeline_lib.data.readers.base import RawChunk, check_columns
from pipeline_lib.data.sources import ListedFile

# Parquet row groups up to this size (uncompressed, the columns read) are decoded whole, one group ahead.
_WHOLE_ROW_GROUP_BYTES = 128 << 20


class ParquetReader:
    """Parquet by record batches of the needed columns, typed by the file's Arrow schema."""

    def __init__(self, fs, source: ListedFile, data: DataConfig):
        self.fs, self.source = fs, source
        self._handle = fs.open(source.path, "rb")
        try:
            self.file = pq.ParquetFile(self._handle)
        except Exception as error:  # noqa: BLE001  (pyarrow raises several types for a non-Parquet file)
            self._handle.close()
            raise_if_outage(error, source.uri, "reading the Parquet footer of")
            raise ConversionError(f"{source.uri} is not a readable Parquet file ({error}); check data.format") from None
        self.names = list(self.file.schema_arrow.names)
        self._groups = range(self.file.num_row_groups)
        self._first_row = 1

    def select_row_groups(self, groups: range) -> None:
        """Read only these row groups (a task's share of the file); rows keep their numbers in the whole file."""
        self._groups = groups
        self._first_row = 1 + sum(self.file.metadata.row_group(g).num_rows for g in range(groups.start))

    def available_columns(self) -> list[str]:
        return list(self.names)

    def use_types(self, types) -> None:
        """Nothing to do: these values are typed, or parsed one by one, as they are read."""

    def guess_number_types(self) -> None:
        """Nothing to do: these values are typed, or parsed one by one, as they are read."""

    def chunks(self, needed: Sequence[str], chunk_rows: int) -> Iterator[RawChunk]:
        check_columns(self.source.uri, self.names, needed)
        first_row = self._first_row
        try:
            for batch in self._batches(list(needed), chunk_rows):
                start = first_row
                yield RawChunk(
                    uri=self.source.uri, unit="row", columns={n: batch.column(n) for n in needed},
                    num_rows=batch.num_rows,
                    positions_fn=lambda start=start, n=batch.num_rows: start + np.arange(n),
                )
                first_row += batch.num_rows
        finally:
            self._handle.close()

    def _batches(self, columns: list[str], chunk_rows: int) -> Iterator[pa.RecordBatch]:
        """Every row group's rows in batches of at most chunk_rows, in file order.

        A row group whose `columns` hold at most _WHOLE_ROW_GROUP_BYTES (uncompressed) is decoded whole, and the
        next such group is decoded on a helper thread while this one's batches are converted: decoding (list
        columns above all) is the slowest step of a Parquet conversion, and whole groups cost less CPU than
        batch-sized reads, which regrow pyarrow's buffers. A larger group is read batch by batch with nothing
        ahead, so memory stays bounded by two groups of that size or by one batch. One ParquetFile is never
        read from two threads at once.
        """
        def whole(group: int) -> bool:
            meta = self.file.metadata.row_group(group)
            size = sum(meta.column(i).total_uncompressed_size for i in range(meta.num_columns)
                       if meta.column(i).path_in_schema.split(".")[0] in columns)
            return size <= _WHOLE_ROW_GROUP_BYTES

        def read(group: int) -> pa.Table:
            return self.file.read_row_group(group, columns=columns, use_threads=False)

        groups = self._groups
        with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tfdag-parquet") as decoder:
            ahead: concurrent.futures.Future | None = None
            try:
                for group in groups:
                    if ahead is not None:
                        table, ahead = ahead.result(), None
                    elif whole(group):
                        table = read(group)
                    else:
                        yield from self.file.iter_batches(batch_size=chunk_rows, columns=columns, row_groups=[group])
                        continue
                    if group + 1 < groups.stop and whole(group + 1):
                        ahead = decoder.submit(read, group + 1)
                    yield from table.to_batches(max_chunksize=chunk_rows)
                    del table
            finally:
                if ahead is not None:  # closed early: let the decode finish before the file closes
                    ahead.cancel()
                    with contextlib.suppress(BaseException):
                        ahead.result()
