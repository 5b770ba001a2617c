"""The bulk Example encoder writes the bytes of TensorFlow's per-row Examples, for every dtype."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import tensorflow as tf

from pipeline_lib.data import encoding
from tests.pipeline_lib.data.encoding_support import (
    DESCRIPTION,
    assert_parsed_equal,
    columns_of_every_dtype,
    reference_example,
)


@pytest.mark.parametrize("num_rows", [1, 6, 37, encoding.BATCH_ROWS + 5])
def test_parse_example_reads_every_dtype_back_identically(num_rows):
    columns = columns_of_every_dtype(num_rows)
    batch = encoding.encode_examples(columns)
    assert len(batch) == num_rows
    parsed = tf.io.parse_example(tf.constant(batch.records()), DESCRIPTION)
    assert_parsed_equal(parsed, columns)


def test_each_record_equals_the_per_row_tf_example_proto():
    columns = columns_of_every_dtype(50, seed=3)
    batch = encoding.encode_examples(columns)
    for row in range(50):
        assert tf.train.Example.FromString(batch.record(row)) == reference_example(columns, row)


def test_fixed_width_rows_serialize_to_the_same_bytes_as_protobuf():
    # With one feature the map order cannot differ, so the bytes must match SerializeToString exactly.
    rng = np.random.default_rng(1)
    for column in (rng.normal(size=(20, 8)).astype(np.float32), rng.integers(-5, 1000, size=20),
                   pa.array(["", "é", "abc"] * 6 + ["z", "zz"])):
        columns = {"only": column}
        batch = encoding.encode_examples(columns)
        assert batch.records() == [reference_example(columns, r).SerializeToString() for r in range(20)]


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


def test_buffer_pool_hands_a_given_back_buffer_out_again_and_keeps_at_most_its_limit():
    from pipeline_lib.data.encoding import BufferPool

    pool = BufferPool(max_buffers=2)
    first = pool.take(1000)
    pool.give_back(first)
    again = pool.take(600)  # the idle 1000-byte buffer fits: the same memory, cut to size
    assert again.nbytes == 600 and np.shares_memory(again, first)
    assert not np.shares_memory(pool.take(2000), first)  # too small for 2000: a new one
    buffers = [pool.take(100) for _ in range(3)]
    for buffer in buffers:
        pool.give_back(buffer)
    pool.give_back(buffers[0])  # given back twice: kept once
    taken = [pool.take(100) for _ in range(3)]
    assert sum(any(np.shares_memory(t, b) for b in buffers) for t in taken) == 2
    pool.give_back(taken[0])
    pool.clear()  # what convert() does at its end: no idle buffer outlives the conversion
    assert not np.shares_memory(pool.take(100), taken[0])
