"""TFRecordFileWriter: the digest beside the write, deterministic gzip, durable files written direct."""

from __future__ import annotations

import gzip
import hashlib

import blake3
import numpy as np
import pytest
import tensorflow as tf

from pipeline_lib.core.digests import DigestAlgorithm
from pipeline_lib.data import direct_io, framing, tfrecord_writer
from tests.pipeline_lib.data.encoding_support import (
    DESCRIPTION,
    assert_parsed_equal,
    columns_of_every_dtype,
    needs_o_direct,
)

_BLOCK = direct_io._DIRECT_BLOCK


# Each algorithm a manifest can name, with its reference implementation (not the dispatch under test).
_REFERENCE = {DigestAlgorithm.SHA256: lambda b: hashlib.sha256(b).hexdigest(),
              DigestAlgorithm.BLAKE3: lambda b: blake3.blake3(b).hexdigest()}


@pytest.mark.parametrize("algorithm", list(DigestAlgorithm))
@pytest.mark.parametrize("compression", ["none", "gzip"])
def test_hashing_beside_the_write_gives_the_digest_of_the_file(tmp_path, compression, algorithm):
    """Blocks over _LARGE_WRITE_BYTES are hashed on the hasher thread while the file write runs."""
    import concurrent.futures

    rng = np.random.default_rng(4)
    framed = framing.encode_tfrecords({"x": rng.normal(size=(40_000, 16)).astype(np.float32)})
    assert framed.num_bytes() > 2 * tfrecord_writer._LARGE_WRITE_BYTES
    path = tmp_path / "hashed.tfrecord"
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as hasher:
        writer = tfrecord_writer.TFRecordFileWriter(str(path), compression, durable=True, hasher=hasher,
                                                    digest=algorithm)
        writer.write(framed, 0, 10)  # a small write: hashed inline
        writer.write(framed, 10, 30_000)  # large: hashed on the hasher thread
        writer.write(framed, 30_000)
        num_records, num_bytes, digest = writer.close()
    content = path.read_bytes()
    assert (num_records, num_bytes) == (40_000, len(content))
    assert digest == _REFERENCE[algorithm](content)
    raw = gzip.decompress(content) if compression == "gzip" else content
    assert raw == framed.view().tobytes()


def test_gzip_files_read_back_with_tf_and_are_deterministic(tmp_path):
    columns = columns_of_every_dtype(120, seed=7)
    framed = framing.encode_tfrecords(columns)
    paths = []
    for name in ("a.tfrecord.gz", "b.tfrecord.gz"):
        writer = tfrecord_writer.TFRecordFileWriter(str(tmp_path / name), "gzip")
        writer.write(framed)
        writer.close()
        paths.append(tmp_path / name)
    assert paths[0].read_bytes() == paths[1].read_bytes()  # mtime 0 in the gzip header
    assert gzip.decompress(paths[0].read_bytes()) == framed.view().tobytes()
    dataset = tf.data.TFRecordDataset(str(paths[0]), compression_type="GZIP").batch(1000)
    assert_parsed_equal(tf.io.parse_example(next(iter(dataset)), DESCRIPTION), columns)


@needs_o_direct
def test_durable_writer_writes_direct_and_its_digest_matches_the_file(tmp_path):
    # The default digest is the one conversion records: BLAKE3.

    framed = framing.encode_tfrecords({"x": np.random.default_rng(8).normal(size=(70_000, 16)).astype(np.float32)})
    assert framed.num_bytes() > _BLOCK
    path = tmp_path / "durable.tfrecord"
    writer = tfrecord_writer.TFRecordFileWriter(str(path), durable=True)
    assert isinstance(writer._file, direct_io.DirectFile) and writer._file.direct
    writer.write(framed, 0, 5)
    writer.write(framed, 5)
    num_records, num_bytes, digest = writer.close()
    content = path.read_bytes()
    assert content == framed.view().tobytes()
    assert (num_records, num_bytes, digest) == (70_000, len(content), blake3.blake3(content).hexdigest())
    plain = tfrecord_writer.TFRecordFileWriter(str(tmp_path / "plain.tfrecord"), durable=True, direct=False)
    assert not isinstance(plain._file, direct_io.DirectFile)
    plain.write(framed)
    assert plain.close() == (num_records, num_bytes, digest)
