"""The train step both loops run: per-example losses, one replica's update, and one global step over replicas."""

from __future__ import annotations

from collections.abc import Callable

import keras
import tensorflow as tf

from pipeline_lib.config import Task

LossFn = Callable[[tf.Tensor, tf.Tensor], tf.Tensor]


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
                      task: Task, global_batch: int, mixed_precision: bool, jit_compile: bool = False
                      ) -> Callable[[object], tf.Tensor]:
    """One global step: take every replica's next batch from a distributed iterator, update, return the loss.

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

    Returns:
        `train_step(iterator) -> loss`: the step's loss summed over replicas (each averaged over global_batch).
    """
    per_example_loss = create_loss_fn(task)

    def loss_and_gradients(inputs, labels):
        with tf.GradientTape() as tape:
            logits = model(inputs, training=True)
            loss = tf.nn.compute_average_loss(per_example_loss(labels, logits), global_batch_size=global_batch)
            if model.losses:
                loss += tf.nn.scale_regularization_loss(tf.add_n(model.losses))
            scaled = optimizer.scale_loss(loss) if mixed_precision else loss
        return loss, tape.gradient(scaled, model.trainable_variables)

    if jit_compile:
        loss_and_gradients = tf.function(loss_and_gradients, jit_compile=True)

    def replica_step(inputs, labels):
        loss, gradients = loss_and_gradients(inputs, labels)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        return loss

    def train_step(iterator) -> tf.Tensor:
        inputs, labels = next(iterator)
        per_replica_loss = strategy.run(replica_step, args=(inputs, labels))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica_loss, axis=None)

    return train_step
