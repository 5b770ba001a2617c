"""The train step both loops run: per-example losses, one replica's update, and one global step over replicas."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import keras
import tensorflow as tf

from pipeline_lib.config import Task

LossFn = Callable[[tf.Tensor, tf.Tensor], tf.Tensor]


class StepOutputs(NamedTuple):
    """What a train step returns, as scalars; the loops stack them over an execution (one value per step).

    loss: the step's loss summed over replicas (each averaged over the global batch).
    gradient_norm: the global norm (over all variables) of the gradient each replica computed, unscaled under mixed
        precision, summed over replicas. With one replica (Default, one-device Mirrored, every parameter-server
        step on a one-device worker) it is exactly the norm of the gradient the optimizer applied; with N replicas
        each one's gradient is 1/N of the gradient of its own batch's mean loss, so the sum is the mean of those
        per-batch norms: an upper bound of the applied (all-reduced) gradient's norm, which would cost a second
        all-reduce of every gradient to measure exactly.
    input_wait_s: seconds the step waited for its batch: from right before the step asks the input iterator for it
        to the moment every replica's batch is there, measured inside the step with `tf.timestamp`. A step only
        asks once the previous step is done (the loop's iterations are ordered), so this is the input-bound
        signal: near zero when tf.data's prefetch keeps up, the missing input time when it does not. NaN when not
        measured (`create_train_step(measure_input_wait=False)`), as `gradient_norm` is without
        `measure_gradient_norm`.
    """

    loss: Any
    gradient_norm: Any
    input_wait_s: Any


def create_loss_fn(task: Task) -> LossFn:
    """The per-example loss of a task: sparse softmax cross-entropy, or squared error for regression."""
    if task == Task.CLASSIFICATION:
        def per_example(labels, logits):
            return tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=tf.cast(logits, tf.float32))
    else:
        def per_example(labels, logits):
            return tf.square(tf.cast(tf.reshape(logits, [-1]), tf.float32) - labels)
    return per_example


def create_train_step(strategy: tf.distribute.Strategy, model: keras.Model, optimizer: keras.optimizers.Optimizer,
                      task: Task, global_batch: int, mixed_precision: bool, jit_compile: bool = False,
                      measure_input_wait: bool = True, *, measure_gradient_norm: bool = True
                      ) -> Callable[[object], StepOutputs]:
    """One global step: take every replica's next batch from a distributed iterator, update, return what it measured.

    The step is `tf.function`-safe and has no side effect but the update: the synchronous loop runs several in
    one `tf.function`, the parameter-server coordinator schedules one at a time on the workers.

    Args:
        strategy: the strategy the model and optimizer were built under.
        model: the model to train.
        optimizer: its optimizer (a LossScaleOptimizer under mixed precision).
        task: classification or regression (picks the loss).
        global_batch: the examples of one step over all replicas; the loss is averaged over it.
        mixed_precision: scale the loss before the gradients.
        jit_compile: compile the forward and backward pass with XLA (`train.jit_compile`). The update stays
            outside XLA: under a distribution strategy it all-reduces the gradients across replicas, which a
            compiled cluster cannot do.
        measure_input_wait: time the wait for the batch with TensorFlow's clock op (`tf.timestamp`), which
            TensorFlow refuses to run once op determinism is on (`setup.op_determinism_enabled`): pass False then.
        measure_gradient_norm: compute the gradients' global norm (`observability.step_metrics`); NaN when False.

    Returns:
        `train_step(iterator) -> StepOutputs`: the step's loss, gradient norm and input wait (see `StepOutputs`).
        Measuring them reads the gradients and the clock and changes no value the update computes.
    """
    per_example_loss = create_loss_fn(task)

    def loss_and_gradients(inputs, labels):
        with tf.GradientTape() as tape:
            logits = model(inputs, training=True)
            loss = tf.nn.compute_average_loss(per_example_loss(labels, logits), global_batch_size=global_batch)
            if model.losses:
                loss += tf.nn.scale_regularization_loss(tf.add_n(model.losses))
            scaled = optimizer.scale_loss(loss) if mixed_precision else loss
        # The loss scale, read before the update (which may change it), to report the unscaled gradient's norm.
        scale = optimizer.scale_loss(tf.constant(1.0)) if mixed_precision else tf.constant(1.0)
        return loss, tape.gradient(scaled, model.trainable_variables), scale

    if jit_compile:
        loss_and_gradients = tf.function(loss_and_gradients, jit_compile=True)

    def replica_step(inputs, labels):
        loss, gradients, scale = loss_and_gradients(inputs, labels)
        gradient_norm = (tf.linalg.global_norm(gradients) / tf.cast(scale, tf.float32) if measure_gradient_norm
                         else tf.constant(float("nan")))
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        # One reduce for both scalars: under MultiWorkerMirrored each reduce is a round trip between workers.
        return tf.stack([tf.cast(loss, tf.float32), gradient_norm])

    def next_batch(iterator):
        if not measure_input_wait:
            return next(iterator), tf.constant(float("nan"))
        requested = tf.timestamp()
        with tf.control_dependencies([requested]):
            batch = next(iterator)
        with tf.control_dependencies(tf.nest.flatten(batch, expand_composites=True)):
            return batch, tf.cast(tf.timestamp() - requested, tf.float32)

    def train_step(iterator) -> StepOutputs:
        (inputs, labels), input_wait_s = next_batch(iterator)
        per_replica = strategy.run(replica_step, args=(inputs, labels))
        loss, gradient_norm = tf.unstack(strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None))
        return StepOutputs(loss, gradient_norm, input_wait_s)

    return train_step
