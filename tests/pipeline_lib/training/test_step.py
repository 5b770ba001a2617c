"""Tests for pipeline_lib.training.step: what one step measures besides its loss (gradient norm, input wait), checked
against the same quantities computed outside the step, on one Dense(4) and 16 examples."""

from __future__ import annotations

import time

import keras
import numpy as np
import pytest
import tensorflow as tf

from pipeline_lib.config import Task
from pipeline_lib.training.step import create_loss_fn, create_train_step

GLOBAL_BATCH = 16


def _data():
    rng = np.random.default_rng(3)
    return rng.normal(size=(GLOBAL_BATCH, 5)).astype(np.float32), rng.integers(0, 4, GLOBAL_BATCH).astype(np.int64)


def _mirrored() -> tf.distribute.MirroredStrategy:
    """Two replicas on the two logical CPUs, reducing by copies to one device: collective all-reduces would share
    instance keys with the collectives other tests of this process left behind (a shape mismatch in the suite)."""
    return tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"], cross_device_ops=tf.distribute.ReductionToOneDevice())


def _gradient_norm(model, x, y) -> float:
    """The norm of the gradient of the batch's summed loss / GLOBAL_BATCH, at the model's current weights."""
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(create_loss_fn(Task.CLASSIFICATION)(y, model(x))) / GLOBAL_BATCH
    return float(tf.linalg.global_norm(tape.gradient(loss, model.trainable_variables)))


def _run_steps(strategy, mixed_precision=False, delay_s=0.0, measure_input_wait=True):
    x, y = _data()
    with strategy.scope():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4)])
        optimizer = keras.optimizers.SGD(0.1)
        if mixed_precision:
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer)  # scales the loss by 2**15
    # Replica r gets the r-th slice of the global batch.
    per_replica = GLOBAL_BATCH // strategy.num_replicas_in_sync
    expected_norm = sum(_gradient_norm(model, x[start:start + per_replica], y[start:start + per_replica])
                        for start in range(0, GLOBAL_BATCH, per_replica))
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH).repeat()
    if delay_s:
        def slow(features, labels):
            tf.py_function(lambda: time.sleep(delay_s), [], [])
            return features, labels
        dataset = dataset.map(slow)
    iterator = iter(strategy.experimental_distribute_dataset(dataset))
    step = tf.function(create_train_step(strategy, model, optimizer, Task.CLASSIFICATION, GLOBAL_BATCH,
                                         mixed_precision, measure_input_wait=measure_input_wait))
    outputs = [step(iterator) for _ in range(3)]
    first = {name: float(value) for name, value in outputs[0]._asdict().items()}
    return first, expected_norm, [float(o.input_wait_s) for o in outputs]


@pytest.mark.parametrize("strategy_name", ["default", "mirrored"])
def test_the_gradient_norm_is_the_sum_of_the_replicas_gradient_norms(strategy_name):
    strategy = tf.distribute.get_strategy() if strategy_name == "default" else _mirrored()
    measured, expected, _ = _run_steps(strategy, measure_input_wait=False)
    # One replica: exactly the applied gradient's norm. Two: each replica's, summed (see StepOutputs).
    assert measured["gradient_norm"] == pytest.approx(expected, rel=1e-5)
    assert measured["gradient_norm"] > 0 and np.isfinite(measured["loss"])


def test_the_gradient_norm_is_unscaled_under_a_loss_scale():
    measured, expected, _ = _run_steps(tf.distribute.get_strategy(), mixed_precision=True, measure_input_wait=False)
    assert measured["gradient_norm"] == pytest.approx(expected, rel=1e-4)


@pytest.mark.parametrize("strategy_name", ["default", "mirrored"])
def test_the_input_wait_is_the_time_the_step_waited_for_its_batch(strategy_name, no_op_determinism):
    strategy = tf.distribute.get_strategy() if strategy_name == "default" else _mirrored()
    _, _, waits = _run_steps(strategy, delay_s=0.2)
    _, _, fast = _run_steps(strategy)
    # Each later step asked for a batch that took 0.2 s to make; without the delay a batch is there at once.
    assert all(0.1 < wait < 2.0 for wait in waits[1:]), waits
    assert all(0 <= wait < 0.05 for wait in fast[1:]), fast


def test_without_the_clock_the_input_wait_is_nan_and_the_rest_is_measured():
    measured, expected, waits = _run_steps(tf.distribute.get_strategy(), measure_input_wait=False)
    assert all(np.isnan(wait) for wait in waits)
    assert measured["gradient_norm"] == pytest.approx(expected, rel=1e-5)
