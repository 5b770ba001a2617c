"""Scoring a tfdag SavedModel on raw table rows: DataFrame in, DataFrame out, with nothing of tfdag installed.

This module imports only numpy, pandas and TensorFlow (and MLflow inside `TfdagModel`): it ships with every
logged MLflow model (`code_paths`), where it is imported as the top-level module `tfdag_scoring`, and tfdag's
own scoring (`tfdag predict`, the model check before registration) uses the same code. The SavedModel it
loads carries its columns in `assets.extra/tfdag_serving.json`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

SERVING_JSON = os.path.join("assets.extra", "tfdag_serving.json")
SERVING_SIGNATURE = "serving_default"
EXAMPLES_SIGNATURE = "serve_examples"
PREDICTION = "prediction"
PROBABILITY_PREFIX = "probability_"
DEFAULT_BATCH_ROWS = 4096


class RawRowError(ValueError):
    """A row or column of the input cannot be scored: names the column, the row and the value."""


def probability_column(label_value: Any) -> str:
    return f"{PROBABILITY_PREFIX}{label_value}"


def read_serving_spec(saved_model_dir: str) -> dict[str, Any]:
    """The model's columns, label and task, written beside the SavedModel at export."""
    with open(os.path.join(saved_model_dir, SERVING_JSON)) as handle:
        return json.load(handle)


def _number_column(name: str, values: pd.Series, shape: Sequence[int], offset: int) -> np.ndarray:
    if shape:  # a fixed-length vector per row
        rows = []
        for position, cell in enumerate(values.to_numpy(dtype=object)):
            array = np.full(shape, np.nan, np.float32) if _is_missing(cell) else np.asarray(cell, np.float32)
            if array.shape != tuple(shape):
                raise RawRowError(f"column {name!r}, row {offset + position}: {len(np.ravel(array))} values, the "
                                  f"model takes {int(np.prod(shape))}; send a list of that length")
            rows.append(array)
        return np.stack(rows) if rows else np.zeros((0, *shape), np.float32)
    if pd.api.types.is_bool_dtype(values.dtype):
        return values.to_numpy(dtype=np.float32)
    if pd.api.types.is_numeric_dtype(values.dtype):
        return pd.to_numeric(values).to_numpy(dtype=np.float32, na_value=np.nan)
    converted = pd.to_numeric(values, errors="coerce")
    bad = converted.isna() & ~values.map(_is_missing).astype(bool)
    if bad.any():
        position = int(np.flatnonzero(bad.to_numpy())[0])
        raise RawRowError(f"column {name!r}, row {offset + position}: {values.iloc[position]!r} is not a number; "
                          "send numbers (missing: null or NaN)")
    return converted.to_numpy(dtype=np.float32, na_value=np.nan)


def _is_missing(cell: Any) -> bool:
    if cell is None or cell is pd.NA:
        return True
    try:
        return bool(np.ndim(cell) == 0 and pd.isna(cell))
    except (TypeError, ValueError):
        return False


def _string_column(values: pd.Series, shape: Sequence[int]) -> np.ndarray:
    def text(cell: Any) -> bytes:
        if _is_missing(cell):
            return b""
        return cell if isinstance(cell, bytes) else str(cell).encode()

    if shape:
        return np.asarray([[text(c) for c in np.ravel(cell)] if not _is_missing(cell) else [b""] * int(np.prod(shape))
                           for cell in values.to_numpy(dtype=object)], dtype=object).reshape((-1, *shape))
    return np.asarray([text(c) for c in values.to_numpy(dtype=object)], dtype=object)


def to_tensors(columns: Sequence[Mapping[str, Any]], frame: pd.DataFrame, offset: int = 0) -> dict[str, np.ndarray]:
    """The serving signature's inputs for these rows, by column name: `columns` from `tfdag_serving.json`.

    Raises:
        RawRowError: a column the model takes is absent, or a value does not convert.
    """
    absent = [c["name"] for c in columns if c["name"] not in frame.columns]
    if absent:
        raise RawRowError(f"the input has no column {', '.join(map(repr, absent))}; the model takes columns "
                          f"{[c['name'] for c in columns]} (others are ignored)")
    tensors = {}
    for column in columns:
        name, shape = column["name"], column["shape"]
        values = frame[name]
        if column["dtype"] == "string":
            tensors[name] = _string_column(values, shape)
        else:
            tensors[name] = _number_column(name, values, shape, offset)
    return tensors


class Scorer:
    """A SavedModel exported by tfdag, called on raw rows.

    Args:
        saved_model_dir: the export's `saved_model` directory (local).
        batch_rows: rows per call of the serving signature.
    """

    def __init__(self, saved_model_dir: str, batch_rows: int = DEFAULT_BATCH_ROWS) -> None:
        import tensorflow as tf

        self.spec = read_serving_spec(saved_model_dir)
        self.columns: list[dict[str, Any]] = self.spec["columns"]
        self.batch_rows = int(batch_rows)
        self._loaded = tf.saved_model.load(saved_model_dir)
        self._signature = self._loaded.signatures[SERVING_SIGNATURE]

    @property
    def label_values(self) -> list[Any] | None:
        return self.spec["label"].get("values")

    def output_columns(self) -> list[str]:
        values = self.label_values
        if self.spec["task"] == "classification" and values is not None:
            return [PREDICTION, *(probability_column(v) for v in values)]
        return [PREDICTION]

    def to_tensors(self, frame: pd.DataFrame, offset: int = 0) -> dict[str, np.ndarray]:
        """The serving signature's inputs for these rows: the model's columns (others ignored).

        Raises:
            RawRowError: a column the model takes is absent, or a value does not convert.
        """
        return to_tensors(self.columns, frame, offset)

    def predict_tensors(self, tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The serving signature's outputs (`prediction`, and `probabilities` for classification)."""
        import tensorflow as tf

        inputs = {}
        for column in self.columns:
            dtype = tf.string if column["dtype"] == "string" else tf.float32
            inputs[column["input"]] = tf.constant(tensors[column["name"]], dtype=dtype)
        return {name: value.numpy() for name, value in self._signature(**inputs).items()}

    def predict(self, frame: pd.DataFrame, offset: int = 0) -> pd.DataFrame:
        """`prediction` (the label's own values) and, for classification, `probability_<class>` per class."""
        parts = []
        for start in range(0, max(len(frame), 1), self.batch_rows):
            chunk = frame.iloc[start : start + self.batch_rows]
            parts.append(self._frame(self.predict_tensors(self.to_tensors(chunk, offset + start)), chunk.index))
        return pd.concat(parts) if len(parts) > 1 else parts[0]

    def _frame(self, outputs: Mapping[str, np.ndarray], index: pd.Index) -> pd.DataFrame:
        prediction = outputs[PREDICTION]
        if prediction.dtype == object:
            prediction = np.asarray([v.decode() for v in prediction], dtype=object)
        data: dict[str, Any] = {PREDICTION: prediction}
        if "probabilities" in outputs and self.label_values is not None:
            for i, value in enumerate(self.label_values):
                data[probability_column(value)] = outputs["probabilities"][:, i]
        return pd.DataFrame(data, index=index)


def _frame_of(model_input: Any) -> pd.DataFrame:
    if isinstance(model_input, pd.DataFrame):
        return model_input
    if isinstance(model_input, Mapping):
        return pd.DataFrame({k: list(v) if np.ndim(v) > 1 else v for k, v in model_input.items()})
    return pd.DataFrame(model_input)


try:
    import mlflow.pyfunc as _pyfunc

    class TfdagModel(_pyfunc.PythonModel):
        """The MLflow pyfunc of a tfdag model: raw rows (a DataFrame of the table's columns) in, predictions out."""

        def load_context(self, context) -> None:
            self.scorer = Scorer(context.artifacts["saved_model"])

        # A DataFrame hint: MLflow checks the input against the logged signature, not against the hint.
        def predict(self, context, model_input: pd.DataFrame, params=None) -> pd.DataFrame:
            return self.scorer.predict(_frame_of(model_input))
except ImportError:  # scoring without MLflow (tfdag predict on an export directory)
    TfdagModel = None  # type: ignore[assignment,misc]
