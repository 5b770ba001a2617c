"""The bulk Example encoder and TFRecord framing are byte-compatible with TensorFlow's own writer and parser."""

from __future__ import annotations

import errno
import fcntl
import gzip
import os

import numpy as np
import pyarrow as pa
import pytest
import tensorflow as tf

from pipeline_lib.data import encoding

INT64_MIN, INT64_MAX = np.iinfo(np.int64).min, np.iinfo(np.int64).max


def _columns(num_rows: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    ints = rng.integers(-(2**62), 2**62, size=num_rows)
    special = np.array([0, -1, 1, INT64_MIN, INT64_MAX, 127], dtype=np.int64)
    ints[: min(6, num_rows)] = special[: min(6, num_rows)]
    floats = rng.normal(size=num_rows).astype(np.float32)
    special_floats = np.array([np.nan, np.inf, -np.inf, -0.0, np.finfo(np.float32).max, np.finfo(np.float32).tiny],
                              dtype=np.float32)
    floats[: min(6, num_rows)] = special_floats[: min(6, num_rows)]
    words = ["", "héllo", "日本語", "a" * 300, "tab\tand\nnewline", "x"]
    strings = [words[i % len(words)] + ("" if i < len(words) else str(i)) for i in range(num_rows)]
    return {
        "small_int": np.arange(num_rows) % 5,  # one-byte varints: the all-fixed fast path
        "int": ints,  # 1..10-byte varints, negatives take 10
        "float": floats,
        "float_vec": rng.normal(size=(num_rows, 3)).astype(np.float32),
        "int_vec": rng.integers(-300, 300, size=(num_rows, 4)),
        "string": pa.array(strings),
        "bool": (np.arange(num_rows) % 2).astype(bool),
    }


def _reference(columns: dict, row: int) -> tf.train.Example:
    """The Example the per-row TensorFlow recipe builds for one row."""
    feature = {}
    for name, values in columns.items():
        if isinstance(values, pa.Array):
            feature[name] = tf.train.Feature(bytes_list=tf.train.BytesList(value=[values[row].as_py().encode()]))
        elif values.dtype.kind == "f":
            feature[name] = tf.train.Feature(float_list=tf.train.FloatList(value=np.atleast_1d(values[row]).tolist()))
        else:
            feature[name] = tf.train.Feature(
                int64_list=tf.train.Int64List(value=np.atleast_1d(values[row]).astype(np.int64).tolist()))
    return tf.train.Example(features=tf.train.Features(feature=feature))


DESCRIPTION = {
    "small_int": tf.io.FixedLenFeature([], tf.int64),
    "int": tf.io.FixedLenFeature([], tf.int64),
    "float": tf.io.FixedLenFeature([], tf.float32),
    "float_vec": tf.io.FixedLenFeature([3], tf.float32),
    "int_vec": tf.io.FixedLenFeature([4], tf.int64),
    "string": tf.io.FixedLenFeature([], tf.string),
    "bool": tf.io.FixedLenFeature([], tf.int64),
}


def _assert_parsed_equal(parsed: dict, columns: dict) -> None:
    for name, values in columns.items():
        got = parsed[name].numpy()
        if isinstance(values, pa.Array):
            assert [v.decode("utf-8") for v in got] == values.to_pylist(), name
        elif values.dtype.kind == "f":
            # Bit-exact, so nan, inf and -0.0 are checked too.
            np.testing.assert_array_equal(got.view(np.uint32), values.astype(np.float32).view(np.uint32), err_msg=name)
        else:
            np.testing.assert_array_equal(got, values.astype(np.int64), err_msg=name)


@pytest.mark.parametrize("num_rows", [1, 6, 37, encoding._BATCH_ROWS + 5])
def test_parse_example_reads_every_dtype_back_identically(num_rows):
    columns = _columns(num_rows)
    batch = encoding.encode_examples(columns)
    assert len(batch) == num_rows
    parsed = tf.io.parse_example(tf.constant(batch.records()), DESCRIPTION)
    _assert_parsed_equal(parsed, columns)


def test_each_record_equals_the_per_row_tf_example_proto():
    columns = _columns(50, seed=3)
    batch = encoding.encode_examples(columns)
    for row in range(50):
        assert tf.train.Example.FromString(batch.record(row)) == _reference(columns, row)


def test_fixed_width_rows_serialize_to_the_same_bytes_as_protobuf():
    # With one feature the map order cannot differ, so the bytes must match SerializeToString exactly.
    rng = np.random.default_rng(1)
    for column in (rng.normal(size=(20, 8)).astype(np.float32), rng.integers(-5, 1000, size=20),
                   pa.array(["", "é", "abc"] * 6 + ["z", "zz"])):
        columns = {"only": column}
        batch = encoding.encode_examples(columns)
        assert batch.records() == [_reference(columns, r).SerializeToString() for r in range(20)]


def test_tfrecord_file_is_byte_identical_to_tf_writer(tmp_path):
    columns = _columns(300, seed=5)
    records = encoding.encode_examples(columns).records()
    expected = tmp_path / "tf.tfrecord"
    with tf.io.TFRecordWriter(str(expected)) as writer:
        for record in records:
            writer.write(record)
    ours = tmp_path / "ours.tfrecord"
    writer = encoding.TFRecordFileWriter(str(ours))
    framed = encoding.encode_tfrecords(columns)
    writer.write(framed, 0, 100)
    writer.write(framed, 100)
    num_records, num_bytes, digest = writer.close()
    assert ours.read_bytes() == expected.read_bytes()
    assert (num_records, num_bytes) == (300, expected.stat().st_size)
    import hashlib

    assert digest == hashlib.sha256(expected.read_bytes()).hexdigest()


@pytest.mark.parametrize("compression", ["none", "gzip"])
def test_hashing_beside_the_write_gives_the_sha256_of_the_file(tmp_path, compression):
    """Blocks over _LARGE_WRITE_BYTES are hashed on the hasher thread while the file write runs."""
    import concurrent.futures
    import hashlib

    rng = np.random.default_rng(4)
    framed = encoding.encode_tfrecords({"x": rng.normal(size=(40_000, 16)).astype(np.float32)})
    assert framed.num_bytes() > 2 * encoding._LARGE_WRITE_BYTES
    path = tmp_path / "hashed.tfrecord"
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as hasher:
        writer = encoding.TFRecordFileWriter(str(path), compression, durable=True, hasher=hasher)
        writer.write(framed, 0, 10)  # a small write: hashed inline
        writer.write(framed, 10, 30_000)  # large: hashed on the hasher thread
        writer.write(framed, 30_000)
        num_records, num_bytes, digest = writer.close()
    content = path.read_bytes()
    assert (num_records, num_bytes) == (40_000, len(content))
    assert digest == hashlib.sha256(content).hexdigest()
    raw = gzip.decompress(content) if compression == "gzip" else content
    assert raw == framed.view().tobytes()


def test_gzip_files_read_back_with_tf_and_are_deterministic(tmp_path):
    columns = _columns(120, seed=7)
    framed = encoding.encode_tfrecords(columns)
    paths = []
    for name in ("a.tfrecord.gz", "b.tfrecord.gz"):
        writer = encoding.TFRecordFileWriter(str(tmp_path / name), "gzip")
        writer.write(framed)
        writer.close()
        paths.append(tmp_path / name)
    assert paths[0].read_bytes() == paths[1].read_bytes()  # mtime 0 in the gzip header
    assert gzip.decompress(paths[0].read_bytes()) == framed.view().tobytes()
    dataset = tf.data.TFRecordDataset(str(paths[0]), compression_type="GZIP").batch(1000)
    _assert_parsed_equal(tf.io.parse_example(next(iter(dataset)), DESCRIPTION), columns)


def test_encoding_in_split_order_gives_slices_that_tf_reads_as_the_selected_rows(tmp_path):
    """Conversion encodes eval rows first and train rows after, then writes the two slices to separate shards."""
    mask = np.random.default_rng(2).random(200) < 0.3
    order = np.concatenate([np.flatnonzero(mask), np.flatnonzero(~mask)])
    for columns in (_columns(200), {"x": np.ones((200, 4), np.float32), "y": np.arange(200) % 3}):
        framed = encoding.encode_tfrecords(columns, order=order)
        examples = encoding.encode_examples(columns).records()
        for name, part, keep in (("eval", framed.rows(0, int(mask.sum())), mask),
                                 ("train", framed.rows(int(mask.sum()), 200), ~mask)):
            path = tmp_path / f"{name}.tfrecord"
            writer = encoding.TFRecordFileWriter(str(path))
            writer.write(part)
            writer.close()
            got = [r.numpy() for r in tf.data.TFRecordDataset(str(path))]
            assert got == [r for r, selected in zip(examples, keep) if selected]


def test_strings_from_numpy_lists_and_binary_arrays_encode_alike():
    values = ["", "ü", "plain"]
    as_arrow = encoding.encode_examples({"s": pa.array(values)}).records()
    assert encoding.encode_examples({"s": values}).records() == as_arrow
    assert encoding.encode_examples({"s": np.array(values)}).records() == as_arrow
    assert encoding.encode_examples({"s": pa.array([v.encode() for v in values], pa.binary())}).records() == as_arrow
    sliced = pa.array(["skip", *values]).slice(1)
    assert encoding.encode_examples({"s": sliced}).records() == as_arrow


def test_encoder_rejects_mismatched_lengths_empty_vectors_and_nulls():
    with pytest.raises(ValueError, match="different numbers of rows"):
        encoding.encode_examples({"a": np.zeros(3), "b": np.zeros(4)})
    with pytest.raises(ValueError, match="length 0"):
        encoding.encode_examples({"a": np.zeros((3, 0))})
    with pytest.raises(ValueError, match="null"):
        encoding.encode_examples({"a": pa.array(["x", None])})
    with pytest.raises(TypeError, match="unsupported dtype"):
        encoding.encode_examples({"a": np.zeros(3, dtype="datetime64[s]")})


@pytest.mark.parametrize("num_rows", [1, 3, encoding._BATCH_ROWS + 7, encoding._FIXED_ROWS + 3])
def test_fixed_width_framing_is_byte_identical_to_tf_writer(tmp_path, num_rows):
    # Only fixed-width fields (float vectors, one-byte varints, bools): the template fast path, and past
    # _FIXED_ROWS the batched path, both give the file tf.io.TFRecordWriter writes for the same Examples.
    rng = np.random.default_rng(num_rows)
    columns = {
        "x": rng.normal(size=(num_rows, 5)).astype(np.float32),
        "label": rng.integers(0, 10, size=num_rows),
        "flag": (np.arange(num_rows) % 2).astype(bool),
    }
    records = encoding.encode_examples(columns).records()
    expected = tmp_path / "tf.tfrecord"
    with tf.io.TFRecordWriter(str(expected)) as writer:
        for record in records:
            writer.write(record)
    framed = encoding.encode_tfrecords(columns)
    assert framed.view().tobytes() == expected.read_bytes()
    sample = np.unique(np.linspace(0, num_rows - 1, 50).astype(int))
    parsed = tf.io.parse_example(tf.constant([records[i] for i in sample]), {
        "x": tf.io.FixedLenFeature([5], tf.float32),
        "label": tf.io.FixedLenFeature([], tf.int64),
        "flag": tf.io.FixedLenFeature([], tf.int64),
    })
    _assert_parsed_equal(parsed, {name: values[sample] for name, values in columns.items()})


def _fixed_columns(num_rows: int, seed: int = 0) -> dict:
    """Numbers only, each int column's varints one length: rows with one byte layout (long keys, wide vectors and
    multi-byte varints make the length prefixes multi-byte too)."""
    rng = np.random.default_rng(seed)
    return {
        "x": rng.normal(size=(num_rows, 40)).astype(np.float32),
        "k" * 200: rng.integers(1 << 14, 1 << 21, size=num_rows),  # 3-byte varints
        "ids": rng.integers(128, 1 << 14, size=(num_rows, 3)).astype(np.uint32),  # 2-byte varints
        "flag": (np.arange(num_rows) % 2).astype(bool),
        "f": rng.normal(size=num_rows).astype(np.float32),
        "label": rng.integers(0, 10, size=num_rows),
    }


def test_record_layout_places_every_value_where_the_encoder_wrote_it():
    columns = _fixed_columns(30)
    layout = encoding.record_layout(columns)
    assert layout is not None and [f.name for f in layout.fields] == list(columns)
    batch = encoding.encode_examples(columns)
    for row in range(30):
        record = bytes(batch.view(row, row + 1))
        assert len(record) == layout.record_bytes
        for field in layout.fields:
            expected = np.asarray(columns[field.name][row]).reshape(-1)
            if field.varint_bytes == 0:
                got = np.frombuffer(record, "<f4", count=field.count, offset=field.offset)
                np.testing.assert_array_equal(got, expected)
            else:
                groups = np.frombuffer(record, np.uint8, count=field.count * field.varint_bytes, offset=field.offset)
                groups = groups.reshape(field.count, field.varint_bytes).astype(np.int64)
                got = ((groups & 0x7F) << (7 * np.arange(field.varint_bytes))).sum(axis=1)
                np.testing.assert_array_equal(got, expected.astype(np.int64))


@pytest.mark.parametrize("columns", [
    {"x": np.array([1.0], np.float32), "s": pa.array(["a"])},  # a string column
    {"n": np.array([5, 200])},  # varints of 1 and 2 bytes
    {"n": np.array([-1, -2])},  # negative int64: 10-byte varints, left to the parser
    {"v": np.zeros((2, 0), np.float32)},  # empty vectors
    {"n": np.array([], np.int64)},  # no rows
])
def test_rows_without_one_layout_have_none(columns):
    assert encoding.record_layout(columns) is None


# --- durable files written with O_DIRECT -----------------------------------------------------------------------

_BLOCK, _ALIGN = encoding._DIRECT_BLOCK, encoding._DIRECT_ALIGN
needs_o_direct = pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="O_DIRECT is Linux-only")


def _write_in_pieces(target, payload: bytes, seed: int) -> None:
    """Write `payload` in random-sized pieces (some bigger than a block, some a few bytes)."""
    rng = np.random.default_rng(seed)
    view, start = memoryview(payload), 0
    while start < len(payload):
        step = int(rng.choice([1, 7, _ALIGN - 1, _ALIGN + 3, _BLOCK // 3, _BLOCK + 11]))
        target.write(view[start:start + step])
        start += step


@needs_o_direct
@pytest.mark.parametrize("size", [0, 1, _ALIGN - 1, _ALIGN, _ALIGN + 1, _BLOCK - 1, _BLOCK, 2 * _BLOCK + 4099])
def test_direct_file_holds_exactly_the_bytes_written_for_any_length(tmp_path, size):
    """Blocks go out whole and aligned; the padded tail is cut off again, so the file is the bytes, no more."""
    payload = np.random.default_rng(size).integers(0, 256, size=size, dtype=np.uint8).tobytes()
    path = tmp_path / "direct.bin"
    target = encoding._DirectFile(str(path))
    assert target.direct, "this file system takes O_DIRECT, so the direct path is the one under test"
    _write_in_pieces(target, payload, seed=size)
    assert target.size == size
    target.close()
    assert path.read_bytes() == payload


@needs_o_direct
def test_a_reused_block_buffer_leaves_nothing_of_the_previous_file(tmp_path):
    """Buffers go back to a pool on close: a short file written after a long one must not carry its bytes."""
    long_payload = b"\xff" * (_BLOCK + 3 * _ALIGN + 17)
    first = encoding._DirectFile(str(tmp_path / "long.bin"))
    first.write(long_payload)
    first.close()
    short = encoding._DirectFile(str(tmp_path / "short.bin"))
    short.write(b"abc")
    short.close()
    assert (tmp_path / "short.bin").read_bytes() == b"abc"
    assert (tmp_path / "long.bin").read_bytes() == long_payload


@needs_o_direct
def test_durable_writer_writes_direct_and_its_sha256_matches_the_file(tmp_path):
    import hashlib

    framed = encoding.encode_tfrecords({"x": np.random.default_rng(8).normal(size=(70_000, 16)).astype(np.float32)})
    assert framed.num_bytes() > _BLOCK
    path = tmp_path / "durable.tfrecord"
    writer = encoding.TFRecordFileWriter(str(path), durable=True)
    assert isinstance(writer._file, encoding._DirectFile) and writer._file.direct
    writer.write(framed, 0, 5)
    writer.write(framed, 5)
    num_records, num_bytes, digest = writer.close()
    content = path.read_bytes()
    assert content == framed.view().tobytes()
    assert (num_records, num_bytes, digest) == (70_000, len(content), hashlib.sha256(content).hexdigest())
    plain = encoding.TFRecordFileWriter(str(tmp_path / "plain.tfrecord"), durable=True, direct=False)
    assert not isinstance(plain._file, encoding._DirectFile)
    plain.write(framed)
    assert plain.close() == (num_records, num_bytes, digest)


@needs_o_direct
def test_direct_file_falls_back_to_plain_writes_where_open_refuses_o_direct(tmp_path, monkeypatch):
    real_open = os.open

    def refusing_open(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real_open(path, flags, *args)

    monkeypatch.setattr(encoding.os, "open", refusing_open)
    payload = bytes(range(256)) * (_BLOCK // 256 + 37)
    target = encoding._DirectFile(str(tmp_path / "plain.bin"))
    assert not target.direct
    _write_in_pieces(target, payload, seed=1)
    target.close()
    assert (tmp_path / "plain.bin").read_bytes() == payload


@needs_o_direct
def test_direct_file_carries_on_with_plain_writes_where_a_direct_write_is_refused(tmp_path, monkeypatch):
    """Some file systems accept O_DIRECT at open and refuse the write: the file continues through the page cache."""
    real_write, refused = os.write, []

    def refusing_write(fd, data):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(len(data))
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    monkeypatch.setattr(encoding.os, "write", refusing_write)
    payload = bytes(range(251)) * (3 * _BLOCK // 251)
    target = encoding._DirectFile(str(tmp_path / "refused.bin"))
    assert target.direct
    _write_in_pieces(target, payload, seed=2)
    assert not target.direct and refused == [_BLOCK]
    target.close()
    assert (tmp_path / "refused.bin").read_bytes() == payload


@needs_o_direct
def test_direct_file_raises_other_open_errors_and_aborts_without_writing_the_tail(tmp_path):
    with pytest.raises(FileNotFoundError):
        encoding._DirectFile(str(tmp_path / "missing-dir" / "x.bin"))
    target = encoding._DirectFile(str(tmp_path / "aborted.bin"))
    target.write(b"x" * (_BLOCK + 10))
    target.abort()
    target.abort()  # a second abort is a no-op
    assert (tmp_path / "aborted.bin").stat().st_size == _BLOCK  # the whole block went out, the tail did not
