"""What every source reader provides: the Reader protocol, the raw chunks it yields, and chunk-stream helpers."""

from __future__ import annotations

import concurrent.futures
import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import numpy as np
import pyarrow as pa
from fsspec.utils import infer_compression

from pipeline_lib.config import DataConfig
from pipeline_lib.data.errors import ConversionError
from pipeline_lib.data.sources import ListedFile

MISSING = object()  # a key absent from a JSON object
T = TypeVar("T")


def is_missing(value: Any) -> bool:
    """Whether a JSON value is absent: a key the object lacks, or null."""
    return value is MISSING or value is None


@dataclass
class RawChunk:
    """Up to read_chunk_rows rows of one file, before type conversion.

    `columns` holds pyarrow arrays (CSV: strings, or values parsed to the types `use_types` or
    `guess_number_types` asked for; Parquet: typed), Python lists (JSONL) or numpy arrays (NPZ). `structural`
    lists rows the reader could not split into columns at all: (position, reason).
    `num_bytes`: set by the line readers on uncompressed files, where lines read are bytes of the file.
    """

    uri: str
    unit: str  # "line" or "row"
    columns: dict[str, Any]
    num_rows: int
    positions_fn: Callable[[], np.ndarray]
    structural: list[tuple[int, str]] = field(default_factory=list)
    num_bytes: int | None = None  # the file bytes these rows came from, where the reader knows them (progress)
    _positions: np.ndarray | None = None

    def position(self, row: int) -> int:
        """The 1-based line (CSV, JSONL) or row (Parquet, NPZ) of a row of this chunk in its file."""
        if self._positions is None:
            self._positions = self.positions_fn()
        return int(self._positions[row])


class Reader(Protocol):
    """One open source file of one format; `registry.READERS` maps each DataFormat to its implementation."""

    def __init__(self, fs: Any, source: ListedFile, data: DataConfig) -> None:
        """Open `source` on `fs`; raises ConversionError when the file is not of its format."""

    def available_columns(self) -> list[str]:
        """The column names the file offers (JSONL: the keys of its first object)."""

    def chunks(self, needed: Sequence[str], chunk_rows: int) -> Iterator[RawChunk]:
        """The `needed` columns in chunks of at most `chunk_rows` rows, in file order; closes the file at the end."""

    def use_types(self, types: Mapping[str, pa.DataType]) -> None:
        """The Arrow types coercion will convert the columns to: a reader of text may parse chunks still to come
        straight to them, where that gives the values and bad rows coercion would; the others ignore it."""

    def guess_number_types(self) -> None:
        """Schema inference will read the next chunk: until `use_types`, a reader of text may give a column as
        the int64 or float32 values inference and coercion would make of its text (int64 where every value is an
        integer), where it can tell at no risk; the others ignore it."""


def check_columns(uri: str, available: Sequence[str], needed: Sequence[str]) -> None:
    """Raise a ConversionError naming the `needed` columns that `uri` lacks."""
    missing = [c for c in needed if c not in available]
    if missing:
        raise ConversionError(
            f"{uri} has no column(s) {missing}; available columns: {list(available)}. Fix data.label, "
            "data.features or data.split.key_columns, or make every source file carry these columns"
        )


def stored_bytes(path: str, num_bytes: int) -> int | None:
    """The file bytes that `num_bytes` read bytes took, for a progress report: None for a compressed file."""
    return None if infer_compression(path) else num_bytes


def prepend(first: RawChunk, rest: Iterator[RawChunk]) -> Iterator[RawChunk]:
    """`first`, then the chunks of `rest`; closing this closes `rest` (and its file)."""
    try:
        yield first
        yield from rest
    finally:
        rest.close()


def read_ahead(chunks: Iterator[T]) -> Iterator[T]:
    """Read the next chunk on a helper thread while this one is encoded (Arrow, zlib and ISA-L release the GIL).

    At most two chunks are in memory: the one being converted and the one being read. Any iterator whose items
    are never None can be read ahead so (the CSV reader reads its blocks of lines ahead of their parse).
    """
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tfdag-read") as pool:
        pending = pool.submit(next, chunks, None)
        try:
            while True:
                chunk = pending.result()
                if chunk is None:
                    return
                pending = pool.submit(next, chunks, None)
                yield chunk
        finally:
            pending.cancel()
            with contextlib.suppress(BaseException):
                pending.result()
            chunks.close()
