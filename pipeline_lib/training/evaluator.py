"""Eval metrics at each checkpoint: loss and accuracy (or mae, rmse and r2) over the eval split, computed by the
chief."""

from __future__ import annotations

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
            # Sums over the batch, added up over the split in float64 by the caller: loss, then the task's.
            logits = tf.cast(model(inputs, training=False), tf.float32)
            count = tf.cast(tf.shape(labels)[0], tf.float32)
            loss = tf.reduce_sum(loss_fn(labels, logits))
            if task == Task.CLASSIFICATION:
                hits = tf.reduce_sum(tf.cast(tf.equal(tf.argmax(logits, axis=-1), labels), tf.float32))
                return loss, count, hits
            errors = tf.reshape(logits, [-1]) - labels
            return (loss, count, tf.reduce_sum(tf.abs(errors)), tf.reduce_sum(tf.square(errors)),
                    tf.reduce_sum(labels), tf.reduce_sum(tf.square(labels)))

        self._batch_sums = batch_sums

    def __call__(self) -> dict[str, float]:
        """`eval_<name>` for each of `CHECKPOINT_EVAL_METRICS[task]`: `eval_loss` and `eval_accuracy`
        (classification) or `eval_loss`, `eval_mae`, `eval_rmse` and `eval_r2` (regression, in the label's units, as
        the evaluation reports them; no `eval_r2` when the eval labels are constant); empty without eval data."""
        if self.dataset is None:
            return {}
        sums = None
        for inputs, labels in self.dataset:
            batch = [float(value) for value in self._batch_sums(inputs, labels)]
            sums = batch if sums is None else [a + b for a, b in zip(sums, batch)]
        if not sums or not sums[1]:
            return {}
        loss, count = sums[0], sums[1]
        if self.task == Task.CLASSIFICATION:
            return {"eval_loss": loss / count, "eval_accuracy": sums[2] / count}
        absolute, squared, total, total_squared = sums[2:]
        variance = total_squared / count - (total / count) ** 2  # of the eval labels, for r2
        metrics = {"eval_loss": loss / count, "eval_mae": absolute / count, "eval_rmse": (squared / count) ** 0.5}
        if variance > 0:
            metrics["eval_r2"] = 1.0 - (squared / count) / variance
        return metrics
