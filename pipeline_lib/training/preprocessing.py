"""Preprocessing inside the model, built from the dataset statistics: imputation, z-scores and vocabularies.

Everything here is a Keras layer with its constants fixed at build time (no `adapt`, no pass over the data), so
it is saved in `model.keras` and the SavedModel and a served model takes raw values: NaN (or nothing, as an
empty string) for a missing value, the original units for numbers, the original strings, int64 instants for
dates and timestamps (their calendar parts: `calendar_parts`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
from keras import ops

from pipeline_lib.data.manifest import FeatureSpec, Schema
from pipeline_lib.data.statistics import DatasetStatistics
from pipeline_lib.training.calendar_parts import CalendarFeatures, year_constants
from pipeline_lib.training.column_names import input_names
from pipeline_lib.training.input_pipeline import (
    NUMERIC_KEY,
    numeric_features,
    string_features,
    time_features,
)

DEFAULT_HASH_BINS = 1000
DEFAULT_EMBEDDING_DIM = 8
DEFAULT_MAX_VOCABULARY = 1000
DEFAULT_ONE_HOT_MAX = 16  # vocabularies up to this size (with the out-of-vocabulary slot) are one-hot encoded


@keras.saving.register_keras_serializable(package="tfdag")
class Impute(keras.layers.Layer):
    """NaN in column j of the numeric matrix becomes `fill_values[j]`."""

    def __init__(self, fill_values: Sequence[float], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fill_values = [float(v) for v in fill_values]

    def call(self, x):
        fill = ops.convert_to_tensor(np.asarray(self.fill_values, dtype="float32"), dtype=x.dtype)
        return ops.where(ops.isnan(x), ops.broadcast_to(fill, ops.shape(x)), x)

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "fill_values": self.fill_values}


@keras.saving.register_keras_serializable(package="tfdag")
class MissingIndicator(keras.layers.Layer):
    """1.0 where the numeric matrix's column `columns[k]` is NaN, else 0.0: one output column per entry."""

    def __init__(self, columns: Sequence[int], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.columns = [int(c) for c in columns]

    def call(self, x):
        picked = ops.take(x, np.asarray(self.columns, dtype="int32"), axis=1)
        return ops.cast(ops.isnan(picked), self.compute_dtype)

    def compute_output_shape(self, input_shape):
        return (input_shape[0], len(self.columns))

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "columns": self.columns}


def _size(spec: FeatureSpec) -> int:
    size = 1
    for dim in spec.shape:
        size *= int(dim)
    return size


def numeric_constants(schema: Schema, statistics: DatasetStatistics) -> tuple[list[float], list[float], list[float], list[int]]:
    """(fill values, means, variances, indicator columns) of every column of the `"numeric"` matrix.

    A column without values in the train split gets mean 0 and variance 1; a constant one variance 1, so that a
    value it never took at training time is not divided by zero.
    """
    fills, means, variances, indicators = [], [], [], []
    column = 0
    for spec in numeric_features(schema):
        stats = statistics.feature(spec.name)
        numeric = stats.numeric if stats else None
        has_values = numeric is not None and numeric.count > 0
        mean = float(numeric.mean) if has_values else 0.0
        variance = float(numeric.variance) if has_values and numeric.variance > 0 else 1.0
        imputation = statistics.imputation.get(spec.name)
        fill = imputation.fill_value if imputation else mean
        width = _size(spec)
        fills += [fill] * width
        means += [mean] * width
        variances += [variance] * width
        if imputation and imputation.indicator:
            indicators.append(column)
        column += width
    return fills, means, variances, indicators


def vocabulary(statistics: DatasetStatistics, name: str, max_size: int = DEFAULT_MAX_VOCABULARY) -> list[str]:
    """The most frequent values of a string feature in the train split (at most `max_size`), most frequent first."""
    stats = statistics.feature(name)
    if stats is None or stats.string is None:
        return []
    return [value for value, _count in stats.string.top(max_size)]


def numeric_block(inputs: dict[str, Any], schema: Schema, statistics: DatasetStatistics | None, *,
                  normalize: bool = True, indicators: bool = True):
    """The `"numeric"` input imputed, normalized (z-scores, when `normalize`) and, when `indicators`, followed by
    the `<column>_missing` indicators; the raw input without statistics; None without numeric features."""
    if NUMERIC_KEY not in inputs:
        return None
    x = inputs[NUMERIC_KEY]
    if statistics is None:
        return x
    fills, means, variances, indicator_columns = numeric_constants(schema, statistics)
    imputed = Impute(fills, dtype="float32", name="impute")(x)
    if normalize:
        imputed = keras.layers.Normalization(mean=np.asarray(means), variance=np.asarray(variances),
                                             dtype="float32", name="normalize")(imputed)
    if indicators and indicator_columns:
        flags = MissingIndicator(indicator_columns, dtype="float32", name="missing_indicators")(x)
        imputed = keras.layers.Concatenate(name="numeric_with_indicators")([imputed, flags])
    return imputed


def string_blocks(inputs: dict[str, Any], schema: Schema, statistics: DatasetStatistics | None,
                  params: dict[str, Any], *, normalize: bool = True) -> list[Any]:
    """One tensor per string feature: its vocabulary (from the statistics, with an out-of-vocabulary slot that
    also takes a missing value) one-hot encoded when small, else embedded; hashed and embedded without
    statistics or with `normalize` false."""
    dim = int(params.get("embedding_dim", DEFAULT_EMBEDDING_DIM))
    outputs = []
    names = input_names(schema)  # a column's key in `inputs`, and its layers' names with a suffix
    for spec in string_features(schema):
        values = (vocabulary(statistics, spec.name, int(params.get("max_vocabulary", DEFAULT_MAX_VOCABULARY)))
                  if statistics is not None and normalize else [])
        x, name = inputs[names[spec.name]], names[spec.name]
        if not values:
            bins = int(params.get("hash_bins", DEFAULT_HASH_BINS))
            hashed = keras.layers.Hashing(num_bins=bins, name=f"{name}_hash")(x)
            embedded = keras.layers.Embedding(bins, dim, name=f"{name}_embedding")(hashed)
            outputs.append(keras.layers.Flatten(name=f"{name}_flat")(embedded))
        elif len(values) + 1 <= int(params.get("one_hot_max", DEFAULT_ONE_HOT_MAX)) and _size(spec) == 1:
            one_hot = keras.layers.StringLookup(vocabulary=values, num_oov_indices=1, output_mode="one_hot",
                                                name=f"{name}_lookup")(x)
            outputs.append(keras.layers.Flatten(name=f"{name}_flat")(one_hot))
        else:
            index = keras.layers.StringLookup(vocabulary=values, num_oov_indices=1, name=f"{name}_lookup")(x)
            embedded = keras.layers.Embedding(len(values) + 1, dim, name=f"{name}_embedding")(index)
            outputs.append(keras.layers.Flatten(name=f"{name}_flat")(embedded))
    return outputs


def time_blocks(inputs: dict[str, Any], schema: Schema, statistics: DatasetStatistics | None, *,
                normalize: bool = True, indicators: bool = True) -> list[Any]:
    """One tensor per date or timestamp feature: its calendar parts (`CalendarFeatures`), the year imputed like a
    number's (from the imputation's fill instant) and, when `normalize`, z-scored with the train statistics of
    the instant; with `indicators`, the missing indicator where `data.missing_indicator` asks for one."""
    outputs = []
    names = input_names(schema)
    for spec in time_features(schema):
        name = f"{names[spec.name]}_calendar"
        stats = statistics.feature(spec.name) if statistics is not None else None
        numeric = stats.numeric if stats is not None else None
        has_values = numeric is not None and bool(numeric.count)
        imputation = statistics.imputation.get(spec.name) if statistics is not None else None
        fill, mean, std = year_constants(spec.time, numeric.mean if has_values else None,
                                         numeric.variance if has_values else None,
                                         imputation.fill_value if imputation else None)
        if not normalize:
            mean, std = 0.0, 1.0
        layer = CalendarFeatures(spec.time.value, year_fill=fill, year_mean=mean, year_std=std,
                                 indicator=indicators and bool(imputation and imputation.indicator),
                                 dtype="float32", name=name)
        outputs.append(layer(inputs[names[spec.name]]))
    return outputs


def preprocess_inputs(inputs: dict[str, Any], schema: Schema, statistics: DatasetStatistics | None,
                      params: dict[str, Any] | None = None, *, normalize: bool = True) -> list[Any]:
    """Every input preprocessed, ready to concatenate: what the built-in factories use, and custom ones may.

    Args:
        inputs: `create_inputs(schema)`.
        schema: the data schema.
        statistics: the dataset statistics (None: the raw inputs, strings hashed).
        params: `embedding_dim`, `hash_bins`, `max_vocabulary`, `one_hot_max`.
        normalize: z-score numbers and look strings up in their vocabulary (imputation happens either way).
    """
    params = params or {}
    numeric = numeric_block(inputs, schema, statistics, normalize=normalize)
    return (([numeric] if numeric is not None else [])
            + string_blocks(inputs, schema, statistics, params, normalize=normalize)
            + time_blocks(inputs, schema, statistics, normalize=normalize))

