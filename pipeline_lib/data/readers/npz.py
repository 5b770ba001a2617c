"""The NPZ reader: each `.npy` member streamed chunk by chunk through its header, one column per array."""

from __future__ import annotations

import struct
import zipfile
from collections.abc import Iterator, Sequence

import numpy as np
from isal import isal_zlib

from pipeline_lib.config import DataConfig
from pipeline_lib.data.errors import ConversionError
from pipeline_lib.data.readers.base import RawChunk, check_columns
from pipeline_lib.data.sources import ListedFile

# A zip member's local header: signature, then 22 bytes of fields, then the name's and the extra field's lengths.
_LOCAL_HEADER = struct.Struct("<4s22xHH")
_LOCAL_SIGNATURE = b"PK\x03\x04"


class _StoredMember:
    """An uncompressed (ZIP_STORED, `np.savez`'s) member read straight from the file, its CRC-32 checked as it is.

    What `ZipFile.open` does for such a member, with ISA-L's CRC-32 (vectorized) in place of zlib's: the check is
    the same, and the read of a large `.npz` costs a fraction of its CPU. `read` raises `BadZipFile` at the
    end of a member whose bytes do not match its CRC, as `ZipExtFile` does.
    """

    def __init__(self, handle, info: zipfile.ZipInfo):
        handle.seek(info.header_offset)
        signature, name_length, extra_length = _LOCAL_HEADER.unpack(handle.read(_LOCAL_HEADER.size))
        if signature != _LOCAL_SIGNATURE:
            raise zipfile.BadZipFile(f"Bad magic number for file header of {info.filename!r}")
        self._handle, self.name, self._crc = handle, info.filename, info.CRC
        self._position = info.header_offset + _LOCAL_HEADER.size + name_length + extra_length
        self._left = info.file_size
        self._running = 0

    def read(self, size: int = -1) -> bytes:
        size = self._left if size < 0 else min(size, self._left)
        self._handle.seek(self._position)  # the file is shared with the other members' streams
        data = self._handle.read(size)
        if len(data) < size:
            raise EOFError(f"{self.name!r} ends {self._left - len(data)} bytes early")
        self._position += size
        self._left -= size
        self._running = isal_zlib.crc32(data, self._running)
        if not self._left and self._running != self._crc:
            raise zipfile.BadZipFile(f"Bad CRC-32 for file {self.name!r}")
        return data

    def close(self) -> None:
        """Nothing to release: the reader closes the shared file."""


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

    def _open(self, member: str):
        info = self._zip.getinfo(member)
        if info.compress_type == zipfile.ZIP_STORED and not info.flag_bits & 0x1:  # stored, not encrypted
            return _StoredMember(self._handle, info)
        return self._zip.open(member)  # compressed (`np.savez_compressed`): zipfile inflates and checks it

    def _header(self, member: str):
        stream = self._open(member)
        version = np.lib.format.read_magic(stream)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(stream)
        else:
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(stream)
        return stream, shape, fortran, dtype

    def use_types(self, types) -> None:
        """Nothing to do: these values are typed, or parsed one by one, as they are read."""

    def guess_number_types(self) -> None:
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
