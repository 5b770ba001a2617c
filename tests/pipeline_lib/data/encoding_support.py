"""Shared test data for the encoding, framing and file-writer tests: columns of every dtype and TF's reference."""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pytest
import tensorflow as tf

INT64_MIN, INT64_MAX = np.iinfo(np.int64).min, np.iinfo(np.int64).max


def columns_of_every_dtype(num_rows: int, seed: int = 0) -> dict:
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


def reference_example(columns: dict, row: int) -> tf.train.Example:
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


def assert_parsed_equal(parsed: dict, columns: dict) -> None:
    for name, values in columns.items():
        got = parsed[name].numpy()
        if isinstance(values, pa.Array):
            assert [v.decode("utf-8") for v in got] == values.to_pylist(), name
        elif values.dtype.kind == "f":
            # Bit-exact, so nan, inf and -0.0 are checked too.
            np.testing.assert_array_equal(got.view(np.uint32), values.astype(np.float32).view(np.uint32), err_msg=name)
        else:
            np.testing.assert_array_equal(got, values.astype(np.int64), err_msg=name)


needs_o_direct = pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="O_DIRECT is Linux-only")
