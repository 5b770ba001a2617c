"""TFRecord framing is byte-identical to TensorFlow's writer, in any row order."""

from __future__ import annotations

import blake3
import numpy as np
import pytest
import tensorflow as tf

from pipeline_lib.data import encoding, framing, tfrecord_writer
from tests.pipeline_lib.data.encoding_support import (
    assert_parsed_equal,
    columns_of_every_dtype,
)


def test_tfrecord_file_is_byte_identical_to_tf_writer(tmp_path):
    columns = columns_of_every_dtype(300, seed=5)
    records = encoding.encode_examples(columns).records()
    expected = tmp_path / "tf.tfrecord"
    with tf.io.TFRecordWriter(str(expected)) as writer:
        for record in records:
            writer.write(record)
    ours = tmp_path / "ours.tfrecord"
    writer = tfrecord_writer.TFRecordFileWriter(str(ours))
    framed = framing.encode_tfrecords(columns)
    writer.write(framed, 0, 100)
    writer.write(framed, 100)
    num_records, num_bytes, digest = writer.close()
    assert ours.read_bytes() == expected.read_bytes()
    assert (num_records, num_bytes) == (300, expected.stat().st_size)

    assert digest == blake3.blake3(expected.read_bytes()).hexdigest()


def test_encoding_in_split_order_gives_slices_that_tf_reads_as_the_selected_rows(tmp_path):
    """Conversion encodes eval rows first and train rows after, then writes the two slices to separate shards."""
    mask = np.random.default_rng(2).random(200) < 0.3
    order = np.concatenate([np.flatnonzero(mask), np.flatnonzero(~mask)])
    for columns in (columns_of_every_dtype(200), {"x": np.ones((200, 4), np.float32), "y": np.arange(200) % 3}):
        framed = framing.encode_tfrecords(columns, order=order)
        examples = encoding.encode_examples(columns).records()
        for name, part, keep in (("eval", framed.rows(0, int(mask.sum())), mask),
                                 ("train", framed.rows(int(mask.sum()), 200), ~mask)):
            path = tmp_path / f"{name}.tfrecord"
            writer = tfrecord_writer.TFRecordFileWriter(str(path))
            writer.write(part)
            writer.close()
            got = [r.numpy() for r in tf.data.TFRecordDataset(str(path))]
            assert got == [r for r, selected in zip(examples, keep) if selected]


@pytest.mark.parametrize("num_rows", [1, 3, encoding.BATCH_ROWS + 7, framing._FIXED_ROWS + 3])
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
    framed = framing.encode_tfrecords(columns)
    assert framed.view().tobytes() == expected.read_bytes()
    sample = np.unique(np.linspace(0, num_rows - 1, 50).astype(int))
    parsed = tf.io.parse_example(tf.constant([records[i] for i in sample]), {
        "x": tf.io.FixedLenFeature([5], tf.float32),
        "label": tf.io.FixedLenFeature([], tf.int64),
        "flag": tf.io.FixedLenFeature([], tf.int64),
    })
    assert_parsed_equal(parsed, {name: values[sample] for name, values in columns.items()})


@pytest.mark.parametrize("part_bytes", [1, 1000, 10_000, 1 << 30])
def test_encoding_in_parts_gives_the_records_of_one_batch_in_the_same_order(part_bytes):
    """Conversion frames a chunk in parts of about 4 MiB: put together they are the one batch's bytes and records,
    for fixed-width rows (split into parts; a part smaller than a record holds one record) and for rows of varying
    width (one part)."""
    order = np.random.default_rng(4).permutation(300)
    for columns in ({"x": np.random.default_rng(6).normal(size=(300, 5)).astype(np.float32), "y": np.arange(300) % 3},
                    columns_of_every_dtype(300, seed=7)):
        whole = framing.encode_tfrecords(columns, order=order)
        parts = list(framing.encode_tfrecord_parts(columns, order, part_bytes))
        assert b"".join(part.view().tobytes() for part in parts) == whole.view().tobytes()
        assert [record for part in parts for record in part.records()] == whole.records()
        fixed = "x" in columns
        record_bytes = whole.num_bytes(0, 1)
        expected_parts = -(-300 // max(1, part_bytes // record_bytes)) if fixed else 1
        assert len(parts) == expected_parts
    with pytest.raises(IndexError, match="outside 0..299"):
        next(framing.encode_tfrecord_parts(columns, np.array([300]), 1000))
