"""The CSV reader: chunks of whole lines parsed by pyarrow as strings, each row with its line number."""

from __future__ import annotations

import csv
import io
import itertools
from collections.abc import Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv

from pipeline_lib.config import DataConfig
from pipeline_lib.data.errors import ConversionError
from pipeline_lib.data.readers.base import RawChunk, check_columns, stored_bytes
from pipeline_lib.data.sources import ListedFile


class CsvReader:
    """CSV by lines: chunks of whole lines parsed by pyarrow as strings, so every row keeps its line number.

    One record per line: quoted values with embedded newlines are not supported.
    """

    def __init__(self, fs, source: ListedFile, data: DataConfig):
        self.fs, self.source, self.data = fs, source, data
        with self._open() as handle:
            header = handle.readline().decode("utf-8-sig").rstrip("\r\n")
        if not header:
            raise ConversionError(f"{source.uri} is empty; a CSV source needs a header line with the column names")
        self.names = next(csv.reader([header], delimiter=data.csv_delimiter))
        duplicates = sorted({n for n in self.names if self.names.count(n) > 1})
        if duplicates:
            raise ConversionError(f"{source.uri} line 1 repeats column name(s) {duplicates}; make them unique")

    def available_columns(self) -> list[str]:
        return list(self.names)

    def _open(self):
        return self.fs.open(self.source.path, "rb", compression="infer")

    def chunks(self, needed: Sequence[str], chunk_rows: int) -> Iterator[RawChunk]:
        check_columns(self.source.uri, self.names, needed)
        types = {n: pa.string() for n in self.names}
        with self._open() as handle:
            handle.readline()
            line_start = 2
            while True:
                lines = list(itertools.islice(handle, chunk_rows))
                if not lines:
                    return
                invalid: list[str] = []

                def on_invalid(row, invalid=invalid):
                    invalid.append(row.text)
                    return "skip"

                text = b"".join(lines)
                try:
                    table = pacsv.read_csv(
                        io.BytesIO(text if text.endswith(b"\n") else text + b"\n"),
                        read_options=pacsv.ReadOptions(column_names=self.names, use_threads=False),
                        parse_options=pacsv.ParseOptions(delimiter=self.data.csv_delimiter,
                                                         invalid_row_handler=on_invalid),
                        convert_options=pacsv.ConvertOptions(column_types=types, include_columns=list(needed)),
                    )
                except pa.ArrowInvalid as error:
                    raise ConversionError(
                        f"{self.source.uri} lines {line_start}-{line_start + len(lines) - 1} cannot be parsed as CSV "
                        f"({error}); CSV sources need UTF-8 text, one record per line, and data.csv_delimiter "
                        f"({self.data.csv_delimiter!r}) between fields"
                    ) from None
                structural, positions_fn = self._locate(lines, line_start, invalid)
                yield RawChunk(
                    uri=self.source.uri, unit="line",
                    columns={n: table.column(n).combine_chunks() for n in needed},
                    num_rows=table.num_rows, positions_fn=positions_fn, structural=structural,
                    num_bytes=stored_bytes(self.source.path, lines),
                )
                line_start += len(lines)

    def _locate(self, lines: list[bytes], line_start: int, invalid: list[str]):
        """Structural bad rows now (they are rare), row → line numbers lazily (needed only for bad values)."""
        blank = [i for i, line in enumerate(lines) if not line.strip(b"\r\n")]
        if not blank and not invalid:
            return [], lambda: line_start + np.arange(len(lines))
        expected = len(self.names)
        structural: list[tuple[int, str]] = []
        rows: list[int] = []
        pending = list(invalid)
        blank_set = set(blank)
        for i, line in enumerate(lines):
            if i in blank_set:
                continue
            text = line.rstrip(b"\r\n").decode("utf-8", "replace")
            if pending and text == pending[0]:
                pending.pop(0)
                fields = len(next(csv.reader([text], delimiter=self.data.csv_delimiter), []))
                structural.append((line_start + i, f"has {fields} field(s) but the header has {expected}"))
            else:
                rows.append(line_start + i)
        positions = np.array(rows, dtype=np.int64)
        return structural, lambda: positions
