"""What the chief reports while training: TensorBoard scalars of step time, input wait, learning rate and gradient
norm, read back with TensorBoard's event reader; a slow input pipeline shows up as input wait; under op determinism
the input wait is not measured and the rest is."""

from __future__ import annotations

import math
import statistics
import time

import pytest
import tensorflow as tf

from pipeline_lib.config import parse_config
from pipeline_lib.training import epochs
from pipeline_lib.training import loop as training
from pipeline_lib.training.hooks import TrainHooks
from tests.conftest import make_plan
from tests.pipeline_lib.tensorboard_support import read_scalars

pytestmark = pytest.mark.slow

DELAY_S = 0.05


class ExecutionHooks(TrainHooks):
    def __init__(self):
        self.executions = []

    def on_execution(self, execution):
        self.executions.append(execution)


def _train(tmp_path, manifest, name, observability=None, **train):
    config = parse_config({
        "observability": observability or {},
        "data": {"source": "unused.csv", "label": "label"},
        "model": {"params": {"hidden_units": [16]}},
        "train": {"per_replica_batch_size": 32, "base_learning_rate": 0.01, "lr_scaling": "none",
                  "log_every_steps": 5, "checkpoint_every_steps": 1000, "steps_per_execution": 5, **train},
    })
    hooks = ExecutionHooks()
    result = training.train(config, manifest, make_plan(manifest, steps=20), str(tmp_path / name), hooks=hooks)
    waits = [wait for execution in hooks.executions for wait in execution.input_waits_s]
    assert result.final_step == 20 and len(waits) in (0, 20)
    return result, waits


def _slow_input(monkeypatch):
    """Every batch of the training input takes DELAY_S more to make, prefetched one batch ahead as the real pipeline
    is (a test-only wrap of the loop's dataset_fn)."""
    create = epochs.create_synchronous_dataset_fn

    def slow_dataset_fn(*args, **kwargs):
        dataset_fn = create(*args, **kwargs)

        def sleep(*batch):
            tf.py_function(lambda: time.sleep(DELAY_S), [], [])
            return batch

        return lambda context: dataset_fn(context).map(sleep).prefetch(1)

    monkeypatch.setattr(epochs, "create_synchronous_dataset_fn", slow_dataset_fn)


def _slow_steps(monkeypatch, seconds):
    """Every train step takes `seconds` more after its update (a test-only wrap of the loop's step function)."""
    create = training.create_train_step

    def slow_create_train_step(*args, **kwargs):
        step = create(*args, **kwargs)

        def slow_step(iterator):
            outputs = step(iterator)
            with tf.control_dependencies(tf.nest.flatten(outputs)):
                slept = tf.py_function(lambda: time.sleep(seconds) or 0.0, [], tf.float32)
            with tf.control_dependencies([slept]):
                return type(outputs)(*(tf.identity(value) for value in outputs))

        return slow_step

    monkeypatch.setattr(training, "create_train_step", slow_create_train_step)


def test_tensorboard_has_step_time_input_wait_learning_rate_and_gradient_norm(tmp_path, shared_manifest,
                                                                             no_op_determinism):
    result, waits = _train(tmp_path, shared_manifest, "run")
    assert len(waits) == 20
    scalars = read_scalars(result.tensorboard_dir)
    assert {"loss", "learning_rate", "examples_per_sec", "step_seconds", "input_wait_seconds",
            "gradient_norm"} <= set(scalars), sorted(scalars)
    for tag in ("step_seconds", "input_wait_seconds", "gradient_norm", "learning_rate"):
        assert [step for step, _ in scalars[tag]] == [5, 10, 15, 20], (tag, scalars[tag])
    assert all(value == pytest.approx(0.01) for _, value in scalars["learning_rate"])
    assert all(math.isfinite(value) and value > 0 for _, value in scalars["gradient_norm"])
    assert all(0 < value < 5 for _, value in scalars["step_seconds"])
    # Input wait is part of the step's time; prefetched input keeps it small.
    assert all(0 <= wait <= step for (_, wait), (_, step) in zip(scalars["input_wait_seconds"], scalars["step_seconds"]))
    assert statistics.median(waits) < DELAY_S / 2, waits


def test_a_slow_input_pipeline_shows_as_input_wait(tmp_path, shared_manifest, monkeypatch, no_op_determinism):
    _slow_input(monkeypatch)
    result, waits = _train(tmp_path, shared_manifest, "slow")
    assert len(waits) == 20
    # Each step waits about the delay: the step itself takes far less than DELAY_S on this model.
    assert DELAY_S * 0.6 < statistics.median(waits) < DELAY_S * 4, waits
    scalars = read_scalars(result.tensorboard_dir)
    assert all(DELAY_S * 0.6 < wait for _, wait in scalars["input_wait_seconds"][1:]), scalars["input_wait_seconds"]


def test_input_made_while_the_step_computes_is_no_wait(tmp_path, shared_manifest, monkeypatch, no_op_determinism):
    # Steps of 2 × DELAY_S and batches of DELAY_S: the next batch is ready when a step asks for it, because a step
    # asks only once the previous one is done (its wait does not overlap the previous step's work).
    _slow_input(monkeypatch)
    _slow_steps(monkeypatch, 2 * DELAY_S)
    _, waits = _train(tmp_path, shared_manifest, "slow-steps")
    assert statistics.median(waits) < DELAY_S / 4, waits


def test_a_deterministic_run_reports_no_input_wait_and_everything_else(tmp_path, shared_manifest, no_op_determinism):
    result, waits = _train(tmp_path, shared_manifest, "deterministic", deterministic=True)
    assert waits == []
    scalars = read_scalars(result.tensorboard_dir)
    assert "input_wait_seconds" not in scalars
    assert {"step_seconds", "gradient_norm", "learning_rate"} <= set(scalars)


def test_step_metrics_off_measures_neither_input_wait_nor_gradient_norm(tmp_path, shared_manifest, no_op_determinism):
    result, waits = _train(tmp_path, shared_manifest, "no-step-metrics", observability={"step_metrics": False})
    assert waits == []
    scalars = read_scalars(result.tensorboard_dir)
    assert not {"input_wait_seconds", "gradient_norm"} & set(scalars), sorted(scalars)
    assert {"step_seconds", "learning_rate", "loss"} <= set(scalars)
