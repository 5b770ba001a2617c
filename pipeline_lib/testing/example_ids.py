"""Test-only: a record of the example ids each worker's input pipeline feeds, driven by TFDAG_TEST_EXAMPLE_IDS.

The dataset must have a numeric feature `example_id` holding each row's id. When TFDAG_TEST_EXAMPLE_IDS names a
directory, each worker writes one line per batch its input pipeline yields, `<batch index> <id> <id> ...`, in order,
to `<dir>/worker<W>-of<K>-from<S>.txt` (W: its input pipeline, K: the attempt's workers, S: the step the attempt
started from). A pipeline is read ahead of the steps, so the batches trained are the file's first (steps run ×
replicas per worker) lines; a test knows the steps each attempt ran. Never set it outside tests: the worker entry
loads test support (`worker_support`) only when it is set, and adds the recorder to the training loop's hooks.
"""

from __future__ import annotations

import os

import tensorflow as tf

from pipeline_lib.data.manifest import Schema
from pipeline_lib.training.hooks import TrainHooks
from pipeline_lib.training.input_pipeline import NUMERIC_KEY, numeric_columns

EXAMPLE_IDS_ENV = "TFDAG_TEST_EXAMPLE_IDS"
EXAMPLE_ID_FEATURE = "example_id"
# The feature holds id / EXAMPLE_ID_SCALE: exact in float32 (a power-of-two divisor) for every id below 2**24, and
# on the pixels' scale, so a model that learns from the dataset is not thrown by a feature in the thousands.
EXAMPLE_ID_SCALE = 2048.0


def record_path(directory: str, worker: int, num_workers: int, start_step: int) -> str:
    return os.path.join(directory, f"worker{worker}-of{num_workers}-from{start_step}.txt")


def read_record(path: str) -> list[list[int]]:
    """The batches of one record file, in the order they were fed: each batch's ids."""
    batches: dict[int, list[int]] = {}
    with open(path) as handle:
        for line in handle:
            index, *ids = line.split()
            batches[int(index)] = [int(float(i)) for i in ids]
    return [batches[i] for i in range(len(batches))]


class ExampleIdRecorder(TrainHooks):
    """`TrainHooks.input_batches` for tests: writes the example ids of every batch an input pipeline yields."""

    def __init__(self, directory: str, schema: Schema, num_workers: int):
        columns = numeric_columns(schema)
        if EXAMPLE_ID_FEATURE not in columns:
            raise ValueError(f"TFDAG_TEST_EXAMPLE_IDS is set but the dataset has no numeric feature "
                             f"{EXAMPLE_ID_FEATURE!r} (its numeric features: {sorted(columns)})")
        self.directory, self.column, self.num_workers = directory, columns[EXAMPLE_ID_FEATURE].start, num_workers

    def input_batches(self, batches: tf.data.Dataset, input_pipeline_id: int, start_step: int) -> tf.data.Dataset:
        os.makedirs(self.directory, exist_ok=True)
        path = record_path(self.directory, input_pipeline_id, self.num_workers, start_step)
        open(path, "w").close()

        def write(index: tf.Tensor, ids: tf.Tensor) -> tf.Tensor:
            with open(path, "a") as handle:
                handle.write(" ".join([str(int(index)), *(f"{value * EXAMPLE_ID_SCALE:.0f}" for value in ids.numpy())]) + "\n")
            return index

        def record(index: tf.Tensor, batch):
            inputs, _labels = batch
            done = tf.py_function(write, [index, inputs[NUMERIC_KEY][:, self.column]], tf.int64)
            with tf.control_dependencies([done]):
                return tf.nest.map_structure(tf.identity, batch)

        return batches.enumerate().map(record)
