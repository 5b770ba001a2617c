"""The CSV reader: blocks of whole lines parsed by a C loop or by Arrow on every core, each row with its line number."""

from __future__ import annotations

import csv
import io
from collections.abc import Iterator, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv

from pipeline_lib.config import DataConfig
from pipeline_lib.core import native
from pipeline_lib.data.errors import ConversionError
from pipeline_lib.data.readers.base import (
    RawChunk,
    check_columns,
    read_ahead,
    stored_bytes,
)
from pipeline_lib.data.sources import ListedFile

# Bytes read at a time while a block of whole lines is gathered (the first read also estimates the line length).
_READ_BYTES = 1 << 20
# The C loop's code for each column type it reads (`_native_csv.c`).
_PLAIN_KINDS = {pa.float32(): b"f", pa.int64(): b"q", pa.binary(): b"s"}


class CsvReader:
    """CSV in blocks of `chunk_rows` whole lines, parsed by a C loop or by Arrow; every row keeps its line.

    The happy path: a block is cut at its `chunk_rows`-th newline, and the C loop (`_native_csv.c`) reads it
    straight into the column types `use_types` gave (conversion's inferred types: int64, float32, binary for
    text), or, for the block types are inferred from (`guess_number_types`), into int64 and float32 columns
    where every needed column is a number. It takes only plain values, which Arrow reads to the same values:
    numbers in digits without spaces, ASCII text, no quotes, one field per delimiter. Any other block is parsed by
    Arrow, multi-threaded, straight to the numeric types given, else as strings. Line numbers come from counting
    newlines, which is exact when either found one row per line. A block that is not that simple is parsed again,
    by the path that names every bad row exactly: a value the typed parse refuses, a missing cell, or spaces or
    tabs (a typed parse would trim them, where coercion of the string refuses the value) send the block to a
    string parse; blank lines, rows with the wrong number of fields, a bare carriage return or text that is not
    UTF-8 send it to the line-by-line parse, which skips and locates them. Either way the values, bad rows and
    messages are the ones coercion of the string values gives.

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
        self._types: dict[str, pa.DataType] | None = None  # None: not known (yet)
        self._guess_numbers = False

    def available_columns(self) -> list[str]:
        return list(self.names)

    def use_types(self, types: Mapping[str, pa.DataType]) -> None:
        """Parse the blocks still to come straight to these Arrow types (int64, float32; binary for text)."""
        self._types = dict(types)

    def guess_number_types(self) -> None:
        """Until `use_types`, give a block whose needed columns are all numbers in a plain form on every line as
        int64 and float32 columns (`_parse_plain`)."""
        self._guess_numbers = True

    def _open(self):
        # fsspec infers gzip from the name on any store; its "gzip" codec is ISA-L's igzip when `isal` is
        # installed (a dependency: 0.12 CPU-s to inflate 119 MB of CSV against zlib's 0.46), else the stdlib's.
        return self.fs.open(self.source.path, "rb", compression="infer")

    def chunks(self, needed: Sequence[str], chunk_rows: int) -> Iterator[RawChunk]:
        check_columns(self.source.uri, self.names, needed)
        with self._open() as handle:
            handle.readline()
            line_start = 2
            # The next block is read (and, from a compressed file, decompressed) while this one is parsed.
            for text, num_lines, num_bytes in read_ahead(_line_blocks(handle, chunk_rows)):
                yield self._parse(text, num_lines, line_start, needed, stored_bytes(self.source.path, num_bytes))
                line_start += num_lines

    def _read(self, text: bytes | bytearray, needed: Sequence[str], types: Mapping[str, pa.DataType], threads: bool,
              on_invalid=None) -> pa.Table:
        return pacsv.read_csv(
            pa.BufferReader(text),  # the block's buffer, not a copy
            read_options=pacsv.ReadOptions(column_names=self.names, use_threads=threads),
            parse_options=pacsv.ParseOptions(delimiter=self.data.csv_delimiter, invalid_row_handler=on_invalid),
            # Only an empty cell is null, and only in a typed column (a string column keeps it as ""), so a
            # missing value is told apart from "NA" or "null", which coercion reports as unconvertible.
            convert_options=pacsv.ConvertOptions(column_types={n: types.get(n, pa.string()) for n in self.names},
                                                 include_columns=list(needed), null_values=[""],
                                                 strings_can_be_null=False),
        )

    def _parse(self, text: bytes | bytearray, num_lines: int, line_start: int, needed: Sequence[str],
               num_bytes: int | None) -> RawChunk:
        """One block of `num_lines` lines: the fast parse when it is exact, else the line-by-line one."""
        columns = self._parse_plain(text, num_lines, needed)
        if columns is not None:
            return RawChunk(uri=self.source.uri, unit="line", columns=columns, num_rows=num_lines,
                            positions_fn=lambda: line_start + np.arange(num_lines), num_bytes=num_bytes)
        typed = {n: t for n, t in (self._types or {}).items()  # the numeric ones: Arrow's typed parse
                 if n in needed and (pa.types.is_integer(t) or pa.types.is_floating(t))}
        if typed and (b" " in text or b"\t" in text):
            typed = {}
        one_row_per_line = b"\r" not in text or text.count(b"\r") == text.count(b"\r\n")
        table = None
        attempts = ([typed, {}] if typed else [{}]) if one_row_per_line else []
        for types in attempts:
            try:
                table = self._read(text, needed, types, threads=True)
            except pa.ArrowInvalid:
                table = None
                continue
            if table.num_rows != num_lines:  # a blank line: Arrow skipped it, so rows are not lines
                table = None
                break
            if types and any(table.column(n).null_count for n in types):  # missing cells: reported as strings
                table = None
                continue
            break
        if table is None:
            return self._parse_lines(text, line_start, needed, num_bytes)
        return RawChunk(uri=self.source.uri, unit="line",
                        columns={n: table.column(n).combine_chunks() for n in needed}, num_rows=table.num_rows,
                        positions_fn=lambda: line_start + np.arange(num_lines), num_bytes=num_bytes)

    def _parse_plain(self, text: bytes | bytearray, num_lines: int, needed: Sequence[str]) -> dict[str, pa.Array] | None:
        """The block's columns parsed by the C loop (`_native_csv.c`) when every needed value is plain: no quotes;
        numbers without spaces, in digits Arrow reads to the same values; text in ASCII. To the types `use_types`
        gave, or, before it, with every needed column a number, int64 where every value is an integer and float32
        where not, as schema inference would type them. None otherwise, and Arrow parses the block."""
        if (native.module is None or len(self.data.csv_delimiter) != 1 or b'"' in text
                or (self._types is None and not self._guess_numbers)):
            return None
        wanted = set(needed)
        if self._types is not None:
            codes = b"".join(_PLAIN_KINDS.get(self._types.get(n), b"") if n in wanted else b"-" for n in self.names)
            if len(codes) != len(self.names):  # a needed column of another type
                return None
        else:
            codes = b"".join(b"?" if n in wanted else b"-" for n in self.names)
            codes = native.module.parse_csv_block(text, self.data.csv_delimiter, codes, [], num_lines)
            if not codes:
                return None
        fields = [(n, chr(code)) for n, code in zip(self.names, codes) if n in wanted]
        buffers = {n: [np.empty(num_lines + 1, np.int32), np.empty(len(text), np.uint8)] if kind == "s"
                   else [np.empty(num_lines, np.float32 if kind == "f" else np.int64)] for n, kind in fields}
        if not native.module.parse_csv_block(text, self.data.csv_delimiter, codes,
                                             [b for n, _ in fields for b in buffers[n]], num_lines):
            return None
        columns = {}
        for n, kind in fields:
            if kind == "s":
                offsets, data = buffers[n]
                data = data[:offsets[-1]].copy()  # the bytes of the text only, not room for the whole block
                columns[n] = pa.Array.from_buffers(pa.binary(), num_lines, [None, pa.py_buffer(offsets),
                                                                            pa.py_buffer(data)])
            else:
                columns[n] = pa.array(buffers[n][0])
        return columns

    def _parse_lines(self, text: bytes | bytearray, line_start: int, needed: Sequence[str], num_bytes: int | None) -> RawChunk:
        """A block parsed one-threaded as strings, its rows Arrow cannot split skipped and located by line."""
        lines = io.BytesIO(text).readlines()  # split at b"\n" only, as iterating over the file does
        invalid: list[str] = []

        def on_invalid(row, invalid=invalid):
            invalid.append(row.text)
            return "skip"

        try:
            table = self._read(text, needed, {}, threads=False, on_invalid=on_invalid)
        except pa.ArrowInvalid as error:
            raise ConversionError(
                f"{self.source.uri} lines {line_start}-{line_start + len(lines) - 1} cannot be parsed as CSV "
                f"({error}); CSV sources need UTF-8 text, one record per line, and data.csv_delimiter "
                f"({self.data.csv_delimiter!r}) between fields"
            ) from None
        structural, positions_fn = self._locate(lines, line_start, invalid)
        return RawChunk(uri=self.source.uri, unit="line",
                        columns={n: table.column(n).combine_chunks() for n in needed}, num_rows=table.num_rows,
                        positions_fn=positions_fn, structural=structural, num_bytes=num_bytes)

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


def _line_blocks(handle, num_lines: int) -> Iterator[tuple[bytearray, int, int]]:
    """(text, lines, bytes of the file) for each run of `num_lines` lines of `handle` (fewer at the end).

    A line ends at b"\\n", as iterating over a binary file splits it; a last line without one gets it added
    (not counted in the file's bytes). Each block is read into a buffer of its own, sized by the line length seen
    so far, so it is gathered in a few reads and copied once (the read itself); the lines read past its end are
    copied to the start of the next block's buffer.
    """
    rest = bytearray()  # the lines read past the last block's end
    bytes_per_line = 0.0
    at_end = False

    def wanted(counted: int) -> int:
        return max(_READ_BYTES if not bytes_per_line else int((num_lines - counted) * bytes_per_line * 1.02), 4096)

    while True:
        fill, counted = len(rest), rest.count(b"\n")
        block = bytearray(fill + (wanted(counted) if counted < num_lines else 0))
        block[:fill] = rest
        while counted < num_lines and not at_end:
            if len(block) - fill < wanted(counted):  # the estimate fell short: grow the buffer
                block.extend(bytes(wanted(counted)))
            with memoryview(block) as view, view[fill:] as target:
                got = handle.readinto(target)
            if not got:
                at_end = True
                break
            counted += block.count(b"\n", fill, fill + got)
            fill += got
            if counted:
                bytes_per_line = fill / counted
        del block[fill:]
        if not block:
            return
        if at_end and counted <= num_lines:  # the rest of the file, its last line perhaps without a newline
            cut, lines = fill, counted
        else:
            cut = block.rfind(b"\n") + 1  # the end of the last whole line read
            for _ in range(counted - num_lines):  # back to the end of the block's last line
                cut = block.rfind(b"\n", 0, cut - 1) + 1
            lines = num_lines
        rest = block[cut:]
        del block[cut:]
        num_bytes = cut
        if not block.endswith(b"\n"):  # the file's last line, without its newline
            block += b"\n"
            lines += 1
        yield block, lines, num_bytes
        if at_end and not rest:
            return
