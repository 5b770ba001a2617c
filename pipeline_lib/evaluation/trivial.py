"""The trivial predictor every evaluation scores beside the model: the train split's class frequencies (so its
majority class) for classification, the train split's mean for regression, from the conversion's statistics."""

from __future__ import annotations

import dataclasses

import numpy as np

from pipeline_lib.config import Task
from pipeline_lib.data.manifest import Schema
from pipeline_lib.data.statistics import DatasetStatistics, bucket_start


@dataclasses.dataclass(frozen=True)
class TrivialPredictor:
    """One constant output row for every example: class log-frequencies (logits) or the mean.

    Attributes:
        row: the output every example gets, as wide as the model's output.
        description: what it predicts, for reports (`train mean 152.1`, `majority class 'b' of the train split`).
    """

    row: np.ndarray
    description: str

    def outputs(self, num_examples: int) -> np.ndarray:
        """The outputs for `num_examples` examples, shaped like the model's: [n, units]."""
        return np.tile(self.row, (num_examples, 1))


def _class_counts(schema: Schema, statistics: DatasetStatistics, num_classes: int) -> np.ndarray | None:
    """Train-split count of each class index; None without the label's statistics."""
    label = statistics.feature(schema.label.name, "train")
    if label is None:
        return None
    counts = np.zeros(num_classes, dtype=np.float64)
    if label.string is not None:  # string labels: counted by value; their class is the index in the vocabulary
        index = {value: i for i, value in enumerate(schema.label_vocabulary or ())}
        for value, count in label.string.values.items():
            if index.get(value, num_classes) < num_classes:
                counts[index[value]] += count
        return counts
    if label.numeric is None:
        return None
    # Integer labels: the sketch's bucket of each class. Up to 64 classes every class has its own bucket (a float32
    # holds 0..63 in its 5 top mantissa bits); beyond, a bucket holds 2 or more neighbouring classes and its count
    # goes to the lowest of them.
    for key, count in label.numeric.sketch.items():
        value = round(bucket_start(key))
        if 0 <= value < num_classes:
            counts[value] += count
    return counts


def trivial_predictor(task: Task | str, schema: Schema, statistics: DatasetStatistics | None,
                      num_outputs: int) -> TrivialPredictor | None:
    """The trivial predictor of the train split; None when the dataset has no statistics of its label.

    Classification: the logits are the log of the classes' train frequencies (add-one smoothed, so a class absent
    from train keeps a finite loss): it predicts the majority class and scores loss, accuracy and AUC (0.5) as the
    class prior does. Regression: the train mean of the label.

    Args:
        task: `model.task`.
        schema: the dataset schema (the label, its vocabulary).
        statistics: the conversion's statistics (`data.statistics.load_statistics`).
        num_outputs: the model's output width (classes, or 1).
    """
    if statistics is None:
        return None
    if Task(task) == Task.REGRESSION:
        label = statistics.feature(schema.label.name, "train")
        if label is None or label.numeric is None or label.numeric.mean is None:
            return None
        mean = float(label.numeric.mean)
        return TrivialPredictor(np.full(num_outputs, mean), f"train mean {mean:.6g}")
    counts = _class_counts(schema, statistics, num_outputs)
    if counts is None or not counts.sum():
        return None
    majority = int(counts.argmax())
    names = schema.label_vocabulary
    name = repr(names[majority]) if names and majority < len(names) else str(majority)
    share = counts[majority] / counts.sum()
    logits = np.log((counts + 1.0) / (counts.sum() + num_outputs))
    return TrivialPredictor(logits, f"majority class {name} of the train split ({share:.1%})")
