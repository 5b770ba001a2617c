"""Eval metrics at each checkpoint: loss and accuracy (or mae and rmse) over the eval split, computed by the chief."""

from __future__ import annotations

import math

import keras
import tensorflow as tf

from pipeline_lib.config import Task
from pipeline_lib.data.manifest import Manifest
from pipeline_lib.training import input_pipeline
from pipeline_lib.training.step import create_loss_fn

EVAL_BATCH_SIZE = 256


class Evaluator:
    """Eval metrics on the eval split, computed by the chief alone, outside any replica context.

    Reads of mirrored variables in cross-replica context touch only the local copy, so no collective op
    runs here and the other workers are never waited on.
    """

    def __init__(self, model: keras.Model, manifest: Manifest, task: Task):
        self.task = task
        self.dataset = None
        if manifest.shards_for("eval"):
            self.dataset = input_pipeline.create_dataset(
                manifest, "eval", EVAL_BATCH_SIZE, is_classification=task == Task.CLASSIFICATION)
        loss_fn = create_loss_fn(task)

        @tf.function(reduce_retracing=True)
        def batch_sums(inputs, labels):
            logits = tf.cast(model(inputs, training=False), tf.float32)
            loss = tf.reduce_sum(loss_fn(labels, logits))
            if task == Task.CLASSIFICATION:
                hits = tf.reduce_sum(tf.cast(tf.equal(tf.argmax(logits, axis=-1), labels), tf.float32))
            else:
                hits = tf.reduce_sum(tf.abs(tf.reshape(logits, [-1]) - labels))
            return loss, hits, tf.cast(tf.shape(labels)[0], tf.float32)

        self._batch_sums = batch_sums

    def __call__(self) -> dict[str, float]:
        """`eval_<name>` for each of `CHECKPOINT_EVAL_METRICS[task]`: `eval_loss` and `eval_accuracy`
        (classification) or `eval_loss`, `eval_mae` and `eval_rmse` (regression); empty without eval data."""
        if self.dataset is None:
            return {}
        loss = hits = count = 0.0
        for inputs, labels in self.dataset:
            batch_loss, batch_hits, batch_count = self._batch_sums(inputs, labels)
            loss += float(batch_loss)
            hits += float(batch_hits)
            count += float(batch_count)
        if not count:
            return {}
        metrics = {"eval_loss": loss / count}
        if self.task == Task.CLASSIFICATION:
            metrics["eval_accuracy"] = hits / count
        else:
            metrics["eval_mae"] = hits / count
            metrics["eval_rmse"] = math.sqrt(metrics["eval_loss"])  # the regression loss is the squared error
        return metrics
