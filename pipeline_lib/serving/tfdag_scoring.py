"""Scoring a tfdag SavedModel on raw table rows: DataFrame in, DataFrame out, with nothing of tfdag installed.

This module imports only numpy, pandas and TensorFlow (and MLflow inside `TfdagModel`): it ships with every
logged MLflow model (`code_paths`), where it is imported as the top-level module `tfdag_scoring`, and tfdag's
own scoring (`tfdag predict`, the model check before registration) uses the same code. The SavedModel it
loads carries its columns in `assets.extra/tfdag_serving.json`.

A date or timestamp column goes in as its int64 instant: microseconds (timestamps) or days (dates) since
1970-01-01 UTC, by `tfdag_instants.instant_of`, the rule conversion uses too (it ships beside this module).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

try:  # where the model is loaded: shipped beside this module in code_paths
    from tfdag_instants import MICROS_PER_DAY, MISSING_INSTANT, instant_of
    from tfdag_instants import is_missing as _is_missing
except ImportError:  # where tfdag runs
    from pipeline_lib.data.tfdag_instants import (
        MICROS_PER_DAY,
        MISSING_INSTANT,
        instant_of,
    )
    from pipeline_lib.data.tfdag_instants import is_missing as _is_missing

SERVING_JSON = os.path.join("assets.extra", "tfdag_serving.json")
SERVING_SIGNATURE = "serving_default"
EXAMPLES_SIGNATURE = "serve_examples"
PREDICTION = "prediction"
PROBABILITY_PREFIX = "probability_"
DEFAULT_BATCH_ROWS = 4096
TIME_DTYPES = ("timestamp", "date")  # a serving column's dtype when the model takes an int64 instant


class RawRowError(ValueError):
    """A row or column of the input cannot be scored: names the column, the row and the value.

    For one bad value, `column`, `row` (the row's offset), `value` and `reason` ("is not a number") say which; a
    caller that knows where the rows came from (a file's line) words its own message from them.
    """

    def __init__(self, message: str, *, column: str | None = None, row: int | None = None, value: Any = None,
                 reason: str | None = None) -> None:
        super().__init__(message)
        self.column, self.row, self.value, self.reason = column, row, value, reason


def _bad_value(name: str, row: int, value: Any, reason: str, fix: str) -> RawRowError:
    return RawRowError(f"column {name!r}, row {row}: {value!r} {reason}; {fix}", column=name, row=row, value=value,
                       reason=reason)


def probability_column(label_value: Any) -> str:
    return f"{PROBABILITY_PREFIX}{label_value}"


def read_serving_spec(saved_model_dir: str) -> dict[str, Any]:
    """The model's columns, label and task, written beside the SavedModel at export."""
    with open(os.path.join(saved_model_dir, SERVING_JSON)) as handle:
        return json.load(handle)


def _number_column(name: str, values: pd.Series, shape: Sequence[int], offset: int
                   ) -> tuple[np.ndarray, dict[int, RawRowError]]:
    """The column as float32 (NaN where missing), and each bad row's problem by its position (its value is NaN)."""
    problems: dict[int, RawRowError] = {}
    if shape:  # a fixed-length vector per row
        with contextlib.suppress(TypeError, ValueError):  # every row a list of the right length: one conversion
            stacked = np.asarray(values.tolist(), np.float32)
            if stacked.shape == (len(values), *shape):
                return stacked, problems
        rows = []
        size = int(np.prod(shape))
        for position, cell in enumerate(values.to_numpy(dtype=object)):
            try:
                array = np.full(shape, np.nan, np.float32) if _is_missing(cell) else np.asarray(cell, np.float32)
            except (TypeError, ValueError):
                array = None
            if array is None or array.shape != tuple(shape):
                reason = (f"is not a list of {size} numbers" if array is None
                          else f"has {len(np.ravel(array))} values, the model takes {size}")
                problems[position] = _bad_value(name, offset + position, cell, reason, "send a list of that length")
                array = np.full(shape, np.nan, np.float32)
            rows.append(array)
        return (np.stack(rows) if rows else np.zeros((0, *shape), np.float32)), problems
    if pd.api.types.is_bool_dtype(values.dtype):
        return values.to_numpy(dtype=np.float32), problems
    if pd.api.types.is_numeric_dtype(values.dtype):
        return pd.to_numeric(values).to_numpy(dtype=np.float32, na_value=np.nan), problems
    converted = pd.to_numeric(values, errors="coerce")
    bad = converted.isna() & ~values.map(_is_missing).astype(bool)
    for position in np.flatnonzero(bad.to_numpy()).tolist():
        problems[position] = _bad_value(name, offset + position, values.iloc[position], "is not a number",
                                        "send numbers (missing: null or NaN)")
    return converted.to_numpy(dtype=np.float32, na_value=np.nan), problems


def _time_column(name: str, values: pd.Series, kind: str, offset: int) -> tuple[np.ndarray, dict[int, RawRowError]]:
    """The column as int64 instants (`instant_of`; MISSING_INSTANT where missing or bad), and each bad row's
    problem by its position."""
    problems: dict[int, RawRowError] = {}
    if pd.api.types.is_datetime64_any_dtype(values.dtype):  # pandas' own datetimes: at once, no parsing
        if getattr(values.dtype, "tz", None) is not None:
            values = values.dt.tz_convert("UTC").dt.tz_localize(None)
        missing = values.isna().to_numpy()
        micros = values.to_numpy("datetime64[us]").astype(np.int64)  # floors, as instant_of does
        out = np.floor_divide(micros, MICROS_PER_DAY) if kind == "date" else micros
        out[missing] = MISSING_INSTANT
        return out, problems
    out = np.full(len(values), MISSING_INSTANT, np.int64)
    seen: dict[Any, int | None] = {}  # a column of dates repeats its values
    for position, cell in enumerate(values.to_numpy(dtype=object)):
        try:
            if isinstance(cell, str | bytes):
                instant = seen[cell] if cell in seen else seen.setdefault(cell, instant_of(cell, kind))
            else:
                instant = instant_of(cell, kind)
        except ValueError as error:
            problems[position] = _bad_value(name, offset + position, cell, str(error),
                                            "send a datetime, a date or an ISO 8601 string (missing: null)")
            continue
        if instant is not None:
            out[position] = instant
    return out, problems


def _string_column(values: pd.Series, shape: Sequence[int]) -> np.ndarray:
    def text(cell: Any) -> bytes:
        if _is_missing(cell):
            return b""
        return cell if isinstance(cell, bytes) else str(cell).encode()

    if shape:
        return np.asarray([[text(c) for c in np.ravel(cell)] if not _is_missing(cell) else [b""] * int(np.prod(shape))
                           for cell in values.to_numpy(dtype=object)], dtype=object).reshape((-1, *shape))
    cells = values.to_numpy(dtype=object)
    if set(map(type, cells)) <= {str, bytes, type(None), float}:  # text, None or NaN: TensorFlow encodes str itself
        missing = pd.isna(cells)
        if not missing.any():
            return cells
        cells = cells.copy()
        cells[missing] = b""
        if not all(isinstance(c, (str, bytes)) for c in cells):  # a float that is a number, not NaN
            return np.asarray([text(c) for c in values.to_numpy(dtype=object)], dtype=object)
        return cells
    return np.asarray([text(c) for c in cells], dtype=object)


def convert(columns: Sequence[Mapping[str, Any]], frame: pd.DataFrame,
            offset: int = 0) -> tuple[dict[str, np.ndarray], dict[int, RawRowError]]:
    """The serving signature's inputs for these rows, by column name (`columns` from `tfdag_serving.json`; others
    ignored), without stopping at a bad value: a bad value becomes NaN and, for each row with one, the first
    problem of that row by its position in `frame`.

    Raises:
        RawRowError: a column the model takes is absent.
    """
    absent = [c["name"] for c in columns if c["name"] not in frame.columns]
    if absent:
        raise RawRowError(f"the input has no column {', '.join(map(repr, absent))}; the model takes columns "
                          f"{[c['name'] for c in columns]} (others are ignored)")
    tensors: dict[str, np.ndarray] = {}
    problems: dict[int, RawRowError] = {}
    for column in columns:
        name, shape = column["name"], column["shape"]
        values = frame[name]
        if column["dtype"] == "string":
            tensors[name] = _string_column(values, shape)
        elif column["dtype"] in TIME_DTYPES:
            tensors[name], found = _time_column(name, values, column["dtype"], offset)
            for position, problem in found.items():
                problems.setdefault(position, problem)
        else:
            tensors[name], found = _number_column(name, values, shape, offset)
            for position, problem in found.items():
                problems.setdefault(position, problem)
    return tensors, problems


def to_tensors(columns: Sequence[Mapping[str, Any]], frame: pd.DataFrame, offset: int = 0) -> dict[str, np.ndarray]:
    """`convert`, raising the first bad row's problem.

    Raises:
        RawRowError: a column the model takes is absent, or a value does not convert (the first such row).
    """
    tensors, problems = convert(columns, frame, offset)
    if problems:
        raise problems[min(problems)]
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
            RawRowError: a column the model takes is absent, or a value does not convert (the first such row).
        """
        return to_tensors(self.columns, frame, offset)

    def convert(self, frame: pd.DataFrame, offset: int = 0) -> tuple[dict[str, np.ndarray], dict[int, RawRowError]]:
        """`to_tensors` without stopping at a bad value: the inputs for every row (a bad value NaN) and, for each
        row with a value that does not convert, the first problem of that row by its position in `frame`.

        Raises:
            RawRowError: a column the model takes is absent.
        """
        return convert(self.columns, frame, offset)

    def predict_tensors(self, tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The serving signature's outputs (`prediction`, and `probabilities` for classification)."""
        import tensorflow as tf

        inputs = {}
        for column in self.columns:
            if column["dtype"] == "string":
                inputs[column["input"]] = tf.constant(tensors[column["name"]], dtype=tf.string)
            else:
                dtype = np.int64 if column["dtype"] in TIME_DTYPES else np.float32
                inputs[column["input"]] = tf.constant(np.asarray(tensors[column["name"]], dtype))
        return {name: value.numpy() for name, value in self._signature(**inputs).items()}

    def predict(self, frame: pd.DataFrame, offset: int = 0) -> pd.DataFrame:
        """`prediction` (the label's own values) and, for classification, `probability_<class>` per class."""
        parts = []
        for start in range(0, max(len(frame), 1), self.batch_rows):
            chunk = frame.iloc[start : start + self.batch_rows]
            parts.append(self.to_frame(self.predict_tensors(self.to_tensors(chunk, offset + start)), chunk.index))
        return pd.concat(parts) if len(parts) > 1 else parts[0]

    def output_arrays(self, outputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """`predict_tensors`' outputs as the prediction columns: `prediction` in the label's own values and, for
        classification, `probability_<class>` per class."""
        prediction = outputs[PREDICTION]
        if prediction.dtype == object:
            prediction = np.asarray([v.decode() for v in prediction], dtype=object)
        data: dict[str, np.ndarray] = {PREDICTION: prediction}
        if "probabilities" in outputs and self.label_values is not None:
            for i, value in enumerate(self.label_values):
                data[probability_column(value)] = outputs["probabilities"][:, i]
        return data

    def to_frame(self, outputs: Mapping[str, np.ndarray], index: pd.Index | None = None) -> pd.DataFrame:
        """`predict_tensors`' outputs as `predict` returns them."""
        return pd.DataFrame(self.output_arrays(outputs), index=index)


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
