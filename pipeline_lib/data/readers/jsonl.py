"""The JSON Lines reader: one object per line, parsed line by line so every row knows its line."""

from __future__ import annotations

import contextlib
import itertools
import json
from collections.abc import Iterator, Sequence

import numpy as np

from pipeline_lib.config import DataConfig
from pipeline_lib.data.readers.base import (
    MISSING,
    RawChunk,
    check_columns,
    stored_bytes,
)
from pipeline_lib.data.sources import ListedFile


class JsonlReader:
    """JSON Lines, one object per line, parsed line by line (so every row knows its line)."""

    def __init__(self, fs, source: ListedFile, data: DataConfig):
        self.fs, self.source = fs, source

    def _open(self):
        return self.fs.open(self.source.path, "rb", compression="infer")

    def available_columns(self) -> list[str]:
        """The keys of the first JSON object in the file."""
        with self._open() as handle:
            for line in handle:
                with contextlib.suppress(ValueError):
                    obj = json.loads(line) if line.strip() else None
                    if isinstance(obj, dict):
                        return list(obj)
        return []

    def use_types(self, types) -> None:
        """Nothing to do: these values are typed, or parsed one by one, as they are read."""

    def guess_number_types(self) -> None:
        """Nothing to do: these values are typed, or parsed one by one, as they are read."""

    def chunks(self, needed: Sequence[str], chunk_rows: int) -> Iterator[RawChunk]:
        loads = json.loads
        with self._open() as handle:
            line_no = 0
            first = True
            while True:
                lines = list(itertools.islice(handle, chunk_rows))
                if not lines:
                    return
                columns: dict[str, list] = {n: [] for n in needed}
                positions: list[int] = []
                structural: list[tuple[int, str]] = []
                for line in lines:
                    line_no += 1
                    if not line.strip():
                        continue
                    try:
                        obj = loads(line)
                    except ValueError as error:
                        structural.append((line_no, f"is not valid JSON ({error})"))
                        continue
                    if not isinstance(obj, dict):
                        structural.append((line_no, f"holds a JSON {type(obj).__name__}, not an object"))
                        continue
                    if first:
                        check_columns(f"{self.source.uri} line {line_no}", list(obj), needed)
                        first = False
                    for name in needed:
                        columns[name].append(obj.get(name, MISSING))
                    positions.append(line_no)
                array = np.array(positions, dtype=np.int64)
                yield RawChunk(uri=self.source.uri, unit="line", columns=columns, num_rows=len(positions),
                                positions_fn=lambda array=array: array, structural=structural,
                                num_bytes=stored_bytes(self.source.path, sum(map(len, lines))))
