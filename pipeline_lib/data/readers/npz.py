"""The NPZ reader: each `.npy` member streamed chunk by chunk through its header, one column per array."""

from __future__ import annotations

import zipfile
from collections.abc import Iterator, Sequence

import numpy as np

from pipeline_lib.config import DataConfig
from pipeline_lib.data.errors import ConversionError
from pipeline_lib.data.readers.base import RawChunk, check_columns
from pipeline_lib.data.sources import ListedFile


class NpzReader:
    """NPZ, streamed: each `.npy` member is read chunk by chunk through its header, one column per array.

    1-D arrays are scalar columns and 2-D arrays vector columns; all must have the same first dimension.
    Fortran-ordered arrays cannot be streamed and are loaded whole; object arrays are refused (they need pickle).
    """

    def __init__(self, fs, source: ListedFile, data: DataConfig):
        self.fs, self.source = fs, source
        self._handle = fs.open(source.path, "rb")
        try:
            self._zip = zipfile.ZipFile(self._handle)
        except zipfile.BadZipFile:
            self._handle.close()
            raise ConversionError(f"{source.uri} is not an NPZ (zip) file; check data.format") from None
        self.members = {m[:-4]: m for m in self._zip.namelist() if m.endswith(".npy")}
        self.names = list(self.members)

    def available_columns(self) -> list[str]:
        return list(self.names)

    def _header(self, member: str):
        stream = self._zip.open(member)
        version = np.lib.format.read_magic(stream)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(stream)
        else:
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(stream)
        return stream, shape, fortran, dtype

    def use_types(self, types) -> None:
        """Nothing to do: these values are typed, or parsed one by one, as they are read."""

    def chunks(self, needed: Sequence[str], chunk_rows: int) -> Iterator[RawChunk]:
        check_columns(self.source.uri, self.names, needed)
        streams = {}
        try:
            lengths = {}
            for name in needed:
                stream, shape, fortran, dtype = self._header(self.members[name])
                if dtype.hasobject:
                    raise ConversionError(
                        f"{self.source.uri} array {name!r} has dtype object, which needs pickle; save it with a "
                        "numeric or fixed-width string dtype"
                    )
                if len(shape) not in (1, 2):
                    raise ConversionError(
                        f"{self.source.uri} array {name!r} has shape {shape}; columns must be 1-D (scalars) or 2-D "
                        "(fixed-length vectors)"
                    )
                if fortran:
                    stream.close()
                    with self._zip.open(self.members[name]) as whole:
                        streams[name] = ("array", np.ascontiguousarray(np.lib.format.read_array(whole)), shape, dtype)
                else:
                    streams[name] = ("stream", stream, shape, dtype)
                lengths[name] = shape[0]
            if len(set(lengths.values())) > 1:
                raise ConversionError(
                    f"{self.source.uri} arrays have different lengths {lengths}; every array is one column and "
                    "needs one entry per row"
                )
            total = next(iter(lengths.values()))
            for start in range(0, total, chunk_rows):
                rows = min(chunk_rows, total - start)
                columns = {}
                for name, (kind, obj, shape, dtype) in streams.items():
                    if kind == "array":
                        columns[name] = obj[start : start + rows]
                        continue
                    per_row = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1
                    try:
                        raw = obj.read(rows * per_row * dtype.itemsize)
                    except zipfile.BadZipFile as error:  # the member's CRC-32, checked as np.load does
                        raise ConversionError(
                            f"{self.source.uri} array {name!r} is damaged: {error}; copy or save the file again "
                            "(nothing was written)"
                        ) from None
                    columns[name] = np.frombuffer(raw, dtype=dtype).reshape((rows, *shape[1:]))
                first = start + 1
                yield RawChunk(uri=self.source.uri, unit="row", columns=columns, num_rows=rows,
                                positions_fn=lambda first=first, rows=rows: first + np.arange(rows))
        finally:
            for kind, obj, _shape, _dtype in streams.values():
                if kind == "stream":
                    obj.close()
            self._zip.close()
            self._handle.close()
