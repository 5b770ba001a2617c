"""The CSV reader: blocks of whole records parsed by a C loop or by Arrow on every core, each row with its line."""

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
from pipeline_lib.data.readers.csv_records import (
    READ_BYTES,
    UnclosedQuote,
    record_blocks,
    record_ends,
    record_lines,
    split_records,
)
from pipeline_lib.data.sources import ListedFile

_BOM = b"\xef\xbb\xbf"
# The C loop's code for each column type it reads (`_native_csv.c`).
_PLAIN_KINDS = {pa.float32(): b"f", pa.int64(): b"q", pa.binary(): b"s"}


class CsvReader:
    """CSV (RFC 4180) in blocks of `chunk_rows` whole records, parsed by a C loop or by Arrow; every row keeps the
    line it starts on.

    A block is cut after its `chunk_rows`-th record (`csv_records.record_blocks`): at a newline, never one inside a
    quoted field. The happy path: the C loop (`_native_csv.c`) reads it
    straight into the column types `use_types` gave (conversion's inferred types: int64, float32, binary for
    text), or, for the block types are inferred from (`guess_number_types`), into int64 and float32 columns
    where every needed column is a number. It takes only plain values, which Arrow reads to the same values:
    numbers in digits without spaces, ASCII text, no quotes, one field per delimiter. Any other block is parsed by
    Arrow, multi-threaded, straight to the numeric types given, else as strings (with line breaks inside quoted
    values where the block holds a quote). A row's line is the line its record starts on: newlines counted, and
    where a record spans lines, counted up to each record's start. A block that is not that simple is parsed again,
    by the path that names every bad row exactly: a value the typed parse refuses, a missing cell, or spaces or
    tabs (a typed parse would trim them, where coercion of the string refuses the value) send the block to a
    string parse; blank lines, rows with the wrong number of fields, a bare carriage return or text that is not
    UTF-8 send it to the line-by-line parse, which skips and locates them. Either way the values, bad rows and
    messages are the ones coercion of the string values gives.

    The options (`data.csv_*`, as `pyarrow.csv` names them): the delimiter, the quote character (or none), the
    column names of a file without a header row, and the encoding: UTF-8 (a byte-order mark is skipped), Latin-1
    or cp1252, whose blocks are decoded to UTF-8 before the parse. Bytes the encoding cannot decode are an error
    naming the file, the line and the encoding.
    """

    def __init__(self, fs, source: ListedFile, data: DataConfig):
        self.fs, self.source, self.data = fs, source, data
        self.delimiter, self.quote, self.encoding = data.csv_delimiter, data.csv_quote_char, data.csv_encoding
        self._quote_byte = self.quote.encode() if self.quote is not None else None
        # The bytes before the first data record (a byte-order mark, the header) and the lines they take.
        self._skip_bytes, self._header_lines, names = self._read_header()
        self.names = list(data.csv_column_names) if data.csv_column_names is not None else names
        duplicates = sorted({n for n in self.names if self.names.count(n) > 1})
        if duplicates:
            raise ConversionError(f"{source.uri} line 1 repeats column name(s) {duplicates}; make them unique")
        self._types: dict[str, pa.DataType] | None = None  # None: not known (yet)
        self._guess_numbers = False

    def _read_header(self) -> tuple[int, int, list[str]]:
        """(bytes before the first data record, the lines they take, the header's names: [] without a header)."""
        with self._open() as handle:
            head = handle.read(READ_BYTES)
            bom = len(_BOM) if self.encoding == "utf-8" and head.startswith(_BOM) else 0
            if self.data.csv_column_names is not None:
                return bom, 0, []
            ends, _ = record_ends(head, self.delimiter, self.quote, bom, limit=1)
            while not len(ends):
                more = handle.read(READ_BYTES)
                if not more:
                    break
                head += more
                ends, _ = record_ends(head, self.delimiter, self.quote, bom, limit=1)
        end = int(ends[0]) if len(ends) else len(head)
        header = head[bom:end]
        text = self._decode(header, 1).rstrip("\r\n")
        if not text:
            raise ConversionError(f"{self.source.uri} is empty; a CSV source needs a header line with the column "
                                  "names, or data.csv_column_names for a file without one")
        names = next(csv.reader(io.StringIO(text), **self._dialect()))
        return end, header.count(b"\n") or 1, names

    def _dialect(self) -> dict[str, object]:
        """Python's csv module's options for this file's delimiter and quoting (to read a header or a bad row)."""
        if self.quote is None:
            return {"delimiter": self.delimiter, "quoting": csv.QUOTE_NONE}
        return {"delimiter": self.delimiter, "quotechar": self.quote}

    def _decode(self, text: bytes | bytearray, line_start: int) -> str:
        """`text` decoded from the file's encoding; a ConversionError naming the line of the first byte it cannot."""
        try:
            return text.decode("utf-8" if self.encoding == "utf-8" else self.encoding)
        except UnicodeDecodeError as error:
            line = line_start + text.count(b"\n", 0, error.start)
            raise ConversionError(
                f"{self.source.uri} line {line}: byte {text[error.start:error.start + 1].hex()!r} cannot be decoded "
                f"as {self.encoding} (data.csv_encoding); set data.csv_encoding to the file's encoding (utf-8, "
                "latin-1 or cp1252), or convert the file to UTF-8"
            ) from None

    def _as_utf8(self, text: bytearray, line_start: int) -> bytearray:
        """A block in UTF-8, as Arrow and the C loop read it: decoded from Latin-1 or cp1252 where it is not ASCII."""
        if self.encoding == "utf-8" or text.isascii():
            return text
        return bytearray(self._decode(text, line_start).encode())

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
        # installed (a dependency that inflates in a fraction of zlib's CPU time), else the stdlib's.
        return self.fs.open(self.source.path, "rb", compression="infer")

    def chunks(self, needed: Sequence[str], chunk_rows: int) -> Iterator[RawChunk]:
        check_columns(self.source.uri, self.names, needed)
        with self._open() as handle:
            handle.read(self._skip_bytes)
            line_start = self._header_lines + 1
            # The next block is read (and, from a compressed file, decompressed) while this one is parsed.
            try:
                for text, num_records, num_bytes in read_ahead(record_blocks(handle, chunk_rows, self.delimiter,
                                                                             self.quote)):
                    num_lines = text.count(b"\n")
                    yield self._parse(self._as_utf8(text, line_start), num_records, line_start, needed,
                                      stored_bytes(self.source.path, num_bytes))
                    line_start += num_lines
            except UnclosedQuote as error:
                raise ConversionError(
                    f"{self.source.uri} line {line_start + error.lines_before}: a field opened with "
                    f"data.csv_quote_char ({self.quote!r}) is never closed; close it with a second quote (a quote "
                    "inside a quoted field is written twice), or set data.csv_quote_char: null for a file without "
                    "quoting"
                ) from None

    def _read(self, text: bytes | bytearray, needed: Sequence[str], types: Mapping[str, pa.DataType], threads: bool,
              on_invalid=None) -> pa.Table:
        quoted = self._quote_byte is not None and self._quote_byte in text
        return pacsv.read_csv(
            pa.BufferReader(text),  # the block's buffer, not a copy
            read_options=pacsv.ReadOptions(column_names=self.names, use_threads=threads),
            parse_options=pacsv.ParseOptions(delimiter=self.delimiter, quote_char=self.quote or False,
                                             newlines_in_values=quoted, invalid_row_handler=on_invalid),
            # Only an empty cell is null, and only in a typed column (a string column keeps it as ""), so a
            # missing value is told apart from "NA" or "null", which coercion reports as unconvertible.
            convert_options=pacsv.ConvertOptions(column_types={n: types.get(n, pa.string()) for n in self.names},
                                                 include_columns=list(needed), null_values=[""],
                                                 strings_can_be_null=False),
        )

    def _parse(self, text: bytes | bytearray, num_records: int, line_start: int, needed: Sequence[str],
               num_bytes: int | None) -> RawChunk:
        """One block of `num_records` records: the fast parse when it is exact, else the record-by-record one."""

        def positions_fn():
            return record_lines(text, self.delimiter, self.quote, num_records, line_start)

        columns = self._parse_plain(text, num_records, needed)
        if columns is not None:
            return RawChunk(uri=self.source.uri, unit="line", columns=columns, num_rows=num_records,
                            positions_fn=positions_fn, num_bytes=num_bytes)
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
            if table.num_rows != num_records:  # a blank line: Arrow skipped it, so rows are not records
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
                        positions_fn=positions_fn, num_bytes=num_bytes)

    def _parse_plain(self, text: bytes | bytearray, num_lines: int, needed: Sequence[str]) -> dict[str, pa.Array] | None:
        """The block's columns parsed by the C loop (`_native_csv.c`) when every needed value is plain: no quotes;
        numbers without spaces, in digits Arrow reads to the same values; text in ASCII. To the types `use_types`
        gave, or, before it, with every needed column a number, int64 where every value is an integer and float32
        where not, as schema inference would type them. None otherwise, and Arrow parses the block."""
        if (native.module is None or (self._quote_byte is not None and self._quote_byte in text)
                or (self._types is None and not self._guess_numbers)):
            return None
        wanted = set(needed)
        if self._types is not None:
            codes = b"".join(_PLAIN_KINDS.get(self._types.get(n), b"") if n in wanted else b"-" for n in self.names)
            if len(codes) != len(self.names):  # a needed column of another type
                return None
        else:
            codes = b"".join(b"?" if n in wanted else b"-" for n in self.names)
            codes = native.module.parse_csv_block(text, self.delimiter, codes, [], num_lines)
            if not codes:
                return None
        fields = [(n, chr(code)) for n, code in zip(self.names, codes) if n in wanted]
        buffers = {n: [np.empty(num_lines + 1, np.int32), np.empty(len(text), np.uint8)] if kind == "s"
                   else [np.empty(num_lines, np.float32 if kind == "f" else np.int64)] for n, kind in fields}
        if not native.module.parse_csv_block(text, self.delimiter, codes,
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
        invalid: list[str] = []

        def on_invalid(row, invalid=invalid):
            invalid.append(row.text)
            return "skip"

        try:
            table = self._read(text, needed, {}, threads=False, on_invalid=on_invalid)
        except pa.ArrowInvalid as error:
            self._decode(text, line_start)  # bytes that are not UTF-8: named by line
            quote = f"data.csv_quote_char ({self.quote!r}) around fields holding one, " if self.quote else ""
            last = line_start + text.count(b"\n") - 1
            raise ConversionError(
                f"{self.source.uri} lines {line_start}-{last} cannot be parsed as "
                f"CSV ({error}); CSV sources need {quote}data.csv_delimiter ({self.delimiter!r}) between fields, "
                "and every quoted field closed"
            ) from None
        structural, positions_fn = self._locate(text, line_start, invalid)
        return RawChunk(uri=self.source.uri, unit="line",
                        columns={n: table.column(n).combine_chunks() for n in needed}, num_rows=table.num_rows,
                        positions_fn=positions_fn, structural=structural, num_bytes=num_bytes)

    def _locate(self, text: bytes | bytearray, line_start: int, invalid: list[str]):
        """Structural bad rows now (they are rare), row → line numbers lazily (needed only for bad values)."""
        records = split_records(text, self.delimiter, self.quote)
        blank = [i for i, record in enumerate(records) if not record.strip(b"\r\n")]
        bare_cr = text.count(b"\r") != text.count(b"\r\n")  # records end there too: rows are not counted by ends
        if not blank and not invalid and not bare_cr:
            return [], lambda: record_lines(text, self.delimiter, self.quote, len(records), line_start)
        expected = len(self.names)
        structural: list[tuple[int, str]] = []
        rows: list[int] = []
        pending = list(invalid)
        blank_set = set(blank)
        line = line_start
        for i, record in enumerate(records):
            first, line = line, line + record.count(b"\n")
            if i in blank_set:
                continue
            text = record.rstrip(b"\r\n").decode("utf-8", "replace")
            if pending and text == pending[0]:
                pending.pop(0)
                fields = len(next(csv.reader(io.StringIO(text), **self._dialect()), []))
                structural.append((first, f"has {fields} field(s) but the header has {expected}"))
            else:
                rows.append(first)
        positions = np.array(rows, dtype=np.int64)
        return structural, lambda: positions
