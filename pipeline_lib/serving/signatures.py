"""The exported SavedModel's signatures on raw features: one input per source column, or serialized Examples.

`serving_default` takes one named tensor per column of the table (numbers as float32 with NaN for a missing
value, strings with "" for a missing one, dates and timestamps as int64 instants, days or microseconds since
1970-01-01 UTC, with MISSING_INT64 for a missing one); `serve_examples` takes serialized `tf.train.Example` protos as
TensorFlow Serving and TFX clients send them (an absent feature is a missing value). Both return `prediction`
in the label's own values and, for classification, `probabilities` (one column per class, in label order).
`tfdag_serving.json` in the SavedModel's `assets.extra` lists the columns for `tfdag_scoring`.
"""

from __future__ import annotations

import json
import os
from typing import Any

import keras
import tensorflow as tf

from pipeline_lib.config import Task
from pipeline_lib.data.manifest import DType, FeatureSpec, Schema
from pipeline_lib.data.statistics import MISSING_INT64
from pipeline_lib.serving.tfdag_scoring import (
    EXAMPLES_SIGNATURE,
    PREDICTION,
    SERVING_JSON,
    SERVING_SIGNATURE,
)
from pipeline_lib.training.column_names import input_names
from pipeline_lib.training.input_pipeline import (
    NUMERIC_KEY,
    numeric_features,
    string_features,
    time_features,
)

EXAMPLES_INPUT = "examples"


def label_values(schema: Schema, task: Task) -> list[Any] | None:
    """The label's own values in class order (classification), None for regression."""
    if task != Task.CLASSIFICATION:
        return None
    if schema.label_vocabulary:
        return list(schema.label_vocabulary)
    return list(range(int(schema.num_classes))) if schema.num_classes else None


def _serving_dtype(spec: FeatureSpec) -> str:
    """A column's kind for `tfdag_scoring`: "string", "number", or its `TimeKind` ("timestamp", "date")."""
    if spec.time is not None:
        return spec.time.value
    return "string" if spec.dtype == DType.STRING else "number"


def serving_spec(schema: Schema, task: Task) -> dict[str, Any]:
    """What `tfdag_scoring` needs to call the SavedModel on a table: the columns, the label and the task.

    Each column has its `dtype` for scoring (`_serving_dtype`), its dtype in the records (`source_dtype`) and the
    type it had in the source (`source_type`: a date or timestamp column's Arrow type, else `source_dtype`).
    """
    return {
        "columns": [{"name": f.name, "input": input_names(schema)[f.name], "dtype": _serving_dtype(f),
                     "source_dtype": f.dtype.value, "source_type": f.source_type or f.dtype.value,
                     "shape": list(f.shape)} for f in schema.features],
        "label": {"name": schema.label.name, "dtype": schema.label.dtype.value,
                  "values": label_values(schema, task)},
        "task": task.value,
        "signatures": {SERVING_SIGNATURE: "one input per column", EXAMPLES_SIGNATURE: "serialized tf.train.Example"},
    }


def raw_signature(schema: Schema) -> dict[str, tf.TensorSpec]:
    """`serving_default`'s inputs, by input name (`input_names`): one tensor per feature, batch first."""
    names = input_names(schema)
    dtypes = {DType.STRING: tf.string, DType.FLOAT32: tf.float32, DType.INT64: tf.float32}
    return {names[spec.name]: tf.TensorSpec([None, *spec.shape], tf.int64 if spec.time is not None
                                            else dtypes[spec.dtype], name=names[spec.name])
            for spec in schema.features}


def _size(spec: FeatureSpec) -> int:
    size = 1
    for dim in spec.shape:
        size *= int(dim)
    return size


def raw_to_model_inputs(schema: Schema, columns: dict[str, tf.Tensor]) -> dict[str, tf.Tensor]:
    """The raw columns (by input name) packed into the training inputs dict (`"numeric"`, one per string, one
    int64 instant per date or timestamp)."""
    columns = {spec.name: columns[name] for spec, name in zip(schema.features, input_names(schema).values())}
    inputs: dict[str, tf.Tensor] = {}
    numeric = numeric_features(schema)
    if numeric:
        parts = [tf.reshape(tf.cast(columns[spec.name], tf.float32), [-1, _size(spec)]) for spec in numeric]
        inputs[NUMERIC_KEY] = parts[0] if len(parts) == 1 else tf.concat(parts, axis=1)
    names = input_names(schema)
    for spec in string_features(schema):
        inputs[names[spec.name]] = tf.reshape(columns[spec.name], [-1, _size(spec)])
    for spec in time_features(schema):
        inputs[names[spec.name]] = tf.reshape(tf.cast(columns[spec.name], tf.int64), [-1, 1])
    return inputs


def examples_to_raw(schema: Schema, serialized: tf.Tensor) -> dict[str, tf.Tensor]:
    """Serialized Examples to raw columns (by input name); an absent feature, or conversion's missing int, is NaN or ""
    (a date or timestamp stays its int64 instant, MISSING_INT64 where absent)."""
    defaults = {DType.FLOAT32: float("nan"), DType.INT64: MISSING_INT64, DType.STRING: ""}
    dtypes = {DType.FLOAT32: tf.float32, DType.INT64: tf.int64, DType.STRING: tf.string}
    description = {
        spec.name: tf.io.FixedLenFeature(list(spec.shape), dtypes[spec.dtype],
                                         default_value=tf.fill(list(spec.shape), defaults[spec.dtype])
                                         if spec.shape else defaults[spec.dtype])
        for spec in schema.features
    }
    parsed = tf.io.parse_example(serialized, description)
    columns, names = {}, input_names(schema)
    for spec in schema.features:
        value = parsed[spec.name]
        if spec.dtype == DType.INT64 and spec.time is None:
            value = tf.where(value == MISSING_INT64, tf.constant(float("nan"), tf.float32), tf.cast(value, tf.float32))
        columns[names[spec.name]] = value
    return columns


def _outputs(logits: tf.Tensor, schema: Schema, task: Task) -> dict[str, tf.Tensor]:
    values = label_values(schema, task)
    if values is None:
        return {PREDICTION: tf.reshape(tf.cast(logits, tf.float32), [-1])}
    probabilities = tf.nn.softmax(tf.cast(logits, tf.float32), axis=-1)
    index = tf.argmax(probabilities, axis=-1)
    if schema.label_vocabulary:
        prediction = tf.gather(tf.constant(values, tf.string), index)
    else:
        prediction = index
    return {PREDICTION: prediction, "probabilities": probabilities}


def export_saved_model(model: keras.Model, schema: Schema, task: Task, saved_model_dir: str) -> None:
    """Write the SavedModel with `serving_default` (raw columns) and `serve_examples` (serialized Examples)."""
    archive = keras.export.ExportArchive()
    archive.track(model)

    def score(columns):
        return _outputs(model(raw_to_model_inputs(schema, columns), training=False), schema, task)

    archive.add_endpoint(name=SERVING_SIGNATURE, fn=score, input_signature=[raw_signature(schema)])
    archive.add_endpoint(name=EXAMPLES_SIGNATURE, fn=lambda serialized: score(examples_to_raw(schema, serialized)),
                         input_signature=[tf.TensorSpec([None], tf.string, name=EXAMPLES_INPUT)])
    archive.write_out(saved_model_dir, verbose=False)
    extra = os.path.join(saved_model_dir, os.path.dirname(SERVING_JSON))
    os.makedirs(extra, exist_ok=True)
    with open(os.path.join(saved_model_dir, SERVING_JSON), "w") as handle:
        json.dump(serving_spec(schema, task), handle, indent=2)
