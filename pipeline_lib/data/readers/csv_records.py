"""Where the records of RFC 4180 CSV end, and blocks of whole records cut from a file on those ends.

A record ends at a b"\\n" outside a quoted field; inside one, line breaks are part of the value. The rules are
Arrow's parser's, so a block cut here is whole records as `pyarrow.csv` reads them: a quote opens a quoted field
only as a field's first byte; inside, two quotes are one quote and a single one closes the field; after it,
bytes up to the next delimiter or line end still belong to the field. A block without a quote byte is cut by
counting newlines alone; only blocks that hold a quote are scanned (in C, `_native.csv_record_ends`).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator

import numpy as np

from pipeline_lib.core import native

# The scanner's states, as `_native_csv.c` numbers them.
RECORD_START, IN_FIELD, IN_QUOTES, QUOTE_IN_QUOTES = 0, 1, 2, 3
# Bytes read at a time while a block of whole records is gathered (the first read also estimates their length).
READ_BYTES = 1 << 20


class UnclosedQuote(ValueError):
    """The file ends inside a quoted field: its record starts `lines_before` lines into the block being read."""

    def __init__(self, lines_before: int):
        super().__init__(f"a quoted field opened {lines_before} line(s) into the block is never closed")
        self.lines_before = lines_before


def record_ends(text: bytes | bytearray, delimiter: str, quote: str | None, start: int = 0,
                state: int = RECORD_START, limit: int = 0) -> tuple[np.ndarray, int]:
    """(the position after each record's line end from `start` on, at most `limit` of them when > 0; the scan's
    state where it stopped: after the last end when `limit` stopped it, else at the end of `text`).

    `state` is the state at `start`, so a scan resumes over bytes read later; RECORD_START at a record's start.
    """
    if quote is None or (quote.encode() not in memoryview(text)[start:].tobytes()
                         and state in (RECORD_START, IN_FIELD)):
        return _newline_ends(text, delimiter, start, state, limit)
    return _scan(text, delimiter, quote, start, state, limit)


def _scan(text, delimiter: str, quote: str, start: int, state: int, limit: int) -> tuple[np.ndarray, int]:
    """`record_ends` by the state machine: the C loop, or the same loop in Python where it is not built."""
    if native.module is not None:
        ends, state = native.module.csv_record_ends(text, delimiter, ord(quote), start, state, limit)
        return np.frombuffer(ends, np.int64), state
    return _record_ends_python(bytes(text), delimiter.encode(), quote.encode(), start, state, limit)


def _newline_ends(text, delimiter: str, start: int, state: int, limit: int) -> tuple[np.ndarray, int]:
    """`record_ends` of text where no quote opens a field: every newline ends a record."""
    data = np.frombuffer(text, np.uint8)[start:]
    ends = np.flatnonzero(data == 10) + (start + 1)
    if 0 < limit <= len(ends):
        return ends[:limit], RECORD_START
    if len(data):
        state = RECORD_START if data[-1] in (10, ord(delimiter)) else IN_FIELD
    return ends, state


def _record_ends_python(text: bytes | bytearray, delimiter: bytes, quote: bytes, start: int, state: int,
                        limit: int) -> tuple[np.ndarray, int]:
    """`record_ends` by the same state machine as the C loop, visiting only quotes, delimiters and newlines."""
    ends: list[int] = []
    plain_from = start  # the first byte not yet visited: bytes between visits are plain ones
    for match in re.finditer(b"[" + re.escape(quote + delimiter) + b"\n]", text[start:] if start else text):
        at = match.start() + start
        if at > plain_from and state in (RECORD_START, QUOTE_IN_QUOTES):
            state = IN_FIELD  # a plain byte opened an unquoted field, or followed a closing quote
        plain_from = at + 1
        byte = match.group()
        if state == IN_QUOTES:
            if byte == quote:
                state = QUOTE_IN_QUOTES
            continue
        if byte == quote and state != IN_FIELD:  # opens a quoted field, or is the second of two
            state = IN_QUOTES
        elif byte == b"\n":
            ends.append(at + 1)
            state = RECORD_START
            if len(ends) == limit:
                return np.array(ends, np.int64), state
        else:  # a delimiter, or a quote inside an unquoted field
            state = RECORD_START if byte == delimiter else IN_FIELD
    if len(text) > plain_from and state in (RECORD_START, QUOTE_IN_QUOTES):
        state = IN_FIELD
    return np.array(ends, np.int64), state


def record_lines(text: bytes | bytearray, delimiter: str, quote: str | None, num_records: int,
                 line_start: int) -> np.ndarray:
    """The 1-based line each of the `num_records` records of a block starts on, its first line being `line_start`."""
    if text.count(b"\n") == num_records:  # one record a line
        return line_start + np.arange(num_records)
    ends, _ = record_ends(text, delimiter, quote)
    starts = np.concatenate([[0], ends[:num_records - 1]])
    newlines = np.flatnonzero(np.frombuffer(text, np.uint8) == 10)
    return line_start + np.searchsorted(newlines, starts)


def split_records(text: bytes | bytearray, delimiter: str, quote: str | None) -> list[bytes]:
    """A block's records, each with its line end (the last one too, as blocks end in one), as Arrow's parse splits
    them: a bare carriage return (not before a newline) outside quotes ends a record too, where the block has one."""
    if b"\r" in text and text.count(b"\r") != text.count(b"\r\n"):
        # The same length, each bare CR a newline: the scan then ends records where Arrow's parse does.
        text_ends = re.sub(rb"\r(?!\n)", b"\n", bytes(text))
        ends, _ = record_ends(text_ends, delimiter, quote)
    else:
        ends, _ = record_ends(text, delimiter, quote)
    bounds = [0, *ends.tolist()]
    if bounds[-1] < len(text):
        bounds.append(len(text))
    return [bytes(text[a:b]) for a, b in itertools.pairwise(bounds)]


def record_blocks(handle, num_records: int, delimiter: str = ",",
                  quote: str | None = '"') -> Iterator[tuple[bytearray, int, int]]:
    """(text, records, bytes of the file) for each run of `num_records` records of `handle` (fewer at the end).

    A block never ends inside a quoted field: it ends after a record's line end (b"\\n"), and a last record
    without one gets it added (not counted in the file's bytes). Each block is read into a buffer of its own,
    sized by the record length seen so far, so it is gathered in a few reads and copied once (the read itself);
    the bytes read past its end are copied to the start of the next block's buffer.

    Raises:
        UnclosedQuote: when the file ends inside a quoted field.
    """
    quote_byte = quote.encode() if quote is not None else None
    rest = bytearray()  # the bytes read past the last block's end
    bytes_per_record = 0.0
    at_end = False

    def wanted(counted: int) -> int:
        return max(READ_BYTES if not bytes_per_record else int((num_records - counted) * bytes_per_record * 1.02),
                   4096)

    while True:
        fill = len(rest)
        scan = _BlockScan(delimiter, quote_byte, num_records)
        block = bytearray(fill + wanted(0))
        block[:fill] = rest
        counted = scan.feed(block, 0, fill)
        while counted < num_records and not at_end:
            if len(block) - fill < wanted(counted):  # the estimate fell short: grow the buffer
                block.extend(bytes(wanted(counted)))
            with memoryview(block) as view, view[fill:] as target:
                got = handle.readinto(target)
            if not got:
                at_end = True
                break
            counted = scan.feed(block, fill, fill + got)
            fill += got
            if counted:
                bytes_per_record = scan.last_end / counted
        del block[fill:]
        if not block:
            return
        if counted < num_records:  # the rest of the file, its last record perhaps without a line end
            if scan.scanned is not None and scan.scanned[1] == IN_QUOTES:
                raise UnclosedQuote(block.count(b"\n", 0, scan.last_end))
            cut, records = fill, counted + (fill > scan.last_end)
        else:
            cut, records = scan.last_end, num_records
        rest = block[cut:]
        del block[cut:]
        num_bytes = cut
        if not block.endswith(b"\n"):  # the file's last record, without its line end
            block += b"\n"
        yield block, records, num_bytes
        if at_end and not rest:
            return


class _BlockScan:
    """The record ends in a block as its bytes arrive: newlines counted while it holds no quote, scanned after."""

    def __init__(self, delimiter: str, quote: bytes | None, limit: int):
        self.delimiter, self.quote, self.limit = delimiter, quote, limit
        self.counted = 0
        self.last_end = 0  # the position after the last record end found (the cut, once `limit` are found)
        self.scanned = None  # (position, state) of the quote-aware scan, once the block holds a quote

    def feed(self, block: bytearray, start: int, stop: int) -> int:
        """Take block[start:stop]; return the record ends found so far (at most `limit`)."""
        if self.counted >= self.limit or start == stop:
            return self.counted
        if self.scanned is None and (self.quote is None or block.find(self.quote, start, stop) < 0):
            found = block.count(b"\n", start, stop)
            if self.counted + found < self.limit:
                self.counted += found
                if found:
                    self.last_end = block.rfind(b"\n", start, stop) + 1
                return self.counted
            cut = block.rfind(b"\n", start, stop) + 1
            for _ in range(self.counted + found - self.limit):  # back to the end of the limit-th record
                cut = block.rfind(b"\n", start, cut - 1) + 1
            self.counted, self.last_end = self.limit, cut
            return self.counted
        if self.scanned is None:  # the first quote: scan on from the last record end (no quote before it)
            self.scanned = (self.last_end, RECORD_START)
        position, state = self.scanned
        with memoryview(block) as view, view[:stop] as text:
            ends, state = _scan(text, self.delimiter, self.quote.decode(), position, state, self.limit - self.counted)
        if len(ends):
            self.counted += len(ends)
            self.last_end = int(ends[-1])
        self.scanned = (stop if self.counted < self.limit else self.last_end, state)
        return self.counted
