"""ParallelGzipWriter: blocks deflated on a pool form one gzip stream that gzip and tf.data read, bytes independent of how writes were sliced."""

from __future__ import annotations

import concurrent.futures
import gzip
import io
import zlib

import numpy as np
import pytest

from pipeline_lib.data import parallel_gzip


def _payload(num_bytes: int) -> bytes:
    rng = np.random.default_rng(3)
    return np.round(rng.normal(size=num_bytes // 4), 2).astype(np.float32).tobytes()


def _compress(payload: bytes, slices: list[int], level: int, executor) -> bytes:
    out = io.BytesIO()
    writer = parallel_gzip.ParallelGzipWriter(out, level, executor, max_in_flight=3)
    start = 0
    for stop in [*slices, len(payload)]:
        writer.write(memoryview(payload)[start:stop])
        start = stop
    writer.close()
    return out.getvalue()


@pytest.mark.parametrize("level", [0, 1, 6])
def test_one_gzip_stream_independent_of_write_slicing_and_threads(level):
    payload = _payload(3 * parallel_gzip.BLOCK_BYTES + 12_345)
    serial = _compress(payload, [], level, parallel_gzip.InlineExecutor())
    with concurrent.futures.ThreadPoolExecutor(max_workers=3) as pool:
        sliced = _compress(payload, [7, parallel_gzip.BLOCK_BYTES + 5, 2 * parallel_gzip.BLOCK_BYTES], level, pool)
    assert sliced == serial
    assert gzip.decompress(serial) == payload
    # One member, not several: zlib's gzip decoder stops at the end of the first member.
    decoder = zlib.decompressobj(16 + zlib.MAX_WBITS)
    assert decoder.decompress(serial) == payload and decoder.eof and not decoder.unused_data


def test_empty_stream_is_valid_gzip():
    assert gzip.decompress(_compress(b"", [], 1, parallel_gzip.InlineExecutor())) == b""


def test_level_out_of_range_is_refused():
    with pytest.raises(ValueError, match="level 10"):
        parallel_gzip.ParallelGzipWriter(io.BytesIO(), 10, parallel_gzip.InlineExecutor(), 1)


def test_level_1_is_deflated_by_isal_no_bigger_than_zlib_and_the_others_by_zlib():
    """The default level is ISA-L's fastest (ten times zlib's level 1 on records); the others are zlib's own."""
    from isal import isal_zlib

    payload = _payload(2 * parallel_gzip.BLOCK_BYTES)
    first = payload[: parallel_gzip.BLOCK_BYTES]
    for level, library in ((1, isal_zlib), (6, zlib)):
        compressor = library.compressobj(level, library.DEFLATED, -library.MAX_WBITS)
        block = compressor.compress(first) + compressor.flush(library.Z_SYNC_FLUSH)
        stream = _compress(payload, [], level, parallel_gzip.InlineExecutor())
        assert stream[10 : 10 + len(block)] == block  # after the 10-byte header: the first block, as that library made it
    isal_size = len(_compress(payload, [], 1, parallel_gzip.InlineExecutor()))
    zlib_size = len(gzip.compress(payload, compresslevel=1))
    assert isal_size <= 1.03 * zlib_size  # no bigger than zlib's level 1 (smaller, on these rounded floats)
