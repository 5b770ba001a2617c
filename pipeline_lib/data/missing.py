"""Missing feature values during conversion: impute (written as NaN, MISSING_INT64 or ""), skip or fail, by column.

A value is missing when its cell is empty or null in the source, a string is empty, or a float is already NaN
in the source (a Parquet, NPZ or JSONL column): all of them go through the same `data.missing` settings.
Imputation itself happens inside the model (`training.preprocessing`), from the train split's statistics: so
conversion needs no second pass, and a served model fills in a missing value the same way training did. Here a
missing value is only written in a form the statistics count as missing and the model recognises. A missing
label is never imputed: it stays a bad record, handled by `data.on_bad_record`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline_lib.config import DataConfig, ImputeWith, MissingPolicy
from pipeline_lib.data.coercion import Column
from pipeline_lib.data.errors import ConversionError
from pipeline_lib.data.manifest import DType
from pipeline_lib.data.schema import ColumnType
from pipeline_lib.data.statistics import MISSING_INT64, DatasetStatistics, Imputation

MISSING_REASON = "is missing"


@dataclass
class MissingRows:
    """Rows of a chunk that the missing-value settings decide about, whatever `on_bad_record` says."""

    fail: np.ndarray  # a missing value under `missing: fail`
    skip: np.ndarray  # bad only for missing values under `missing: skip` (no other bad value in the row)


def check_missing_columns(data: DataConfig, features: list[str], uri: str) -> None:
    """Raises ConversionError when `data.missing_columns` names a column that is not a feature."""
    unknown = sorted(set(data.missing_columns) - set(features))
    if unknown:
        raise ConversionError(
            f"data.missing_columns names {unknown}, which are not feature columns of {uri}; features: {features}"
        )


def _missing_mask(column: Column, ctype: ColumnType, num_rows: int) -> np.ndarray:
    mask = np.zeros(num_rows, dtype=bool)
    for row, (_value, why) in column.reasons.items():
        if why == MISSING_REASON:
            mask[row] = True
    if ctype.dtype == DType.STRING and isinstance(column.values, pa.Array):
        empty = pc.fill_null(pc.equal(pc.binary_length(column.values), 0), True)
        mask |= empty.to_numpy(zero_copy_only=False)
    elif ctype.dtype == DType.FLOAT32 and num_rows and np.isnan(column.values.min()):
        # NaN already in the source; min() propagates NaN, so columns without one cost one pass, no mask.
        nan = np.isnan(column.values)
        mask |= nan.reshape(num_rows, -1).any(axis=1)  # a vector: a row with a NaN element
    return mask


def _fill(column: Column, ctype: ColumnType, mask: np.ndarray) -> Column:
    """The column with the `mask` rows set to the missing form and no longer bad."""
    bad = column.bad & ~mask
    reasons = {row: reason for row, reason in column.reasons.items() if not mask[row]}
    if ctype.dtype == DType.STRING:
        values = pc.if_else(pa.array(mask), pa.scalar(b"", column.values.type), column.values)
    else:
        values = np.array(column.values, copy=True)
        if ctype.shape:
            # A vector keeps the elements it has: its NaN ones are filled inside the model, element by element.
            # Only a cell missing whole (null) becomes all NaN.
            mask = mask & ~np.isnan(values).reshape(len(mask), -1).any(axis=1)
        values[mask] = np.nan if ctype.dtype == DType.FLOAT32 else MISSING_INT64
    return Column(values, bad, reasons)


def _mark(column: Column, mask: np.ndarray) -> None:
    for row in np.flatnonzero(mask & ~column.bad).tolist():  # empty strings and NaN: not bad until now
        column.bad[row] = True
        value = column.values[row]
        column.reasons[row] = (float(value) if isinstance(value, np.floating) else "", MISSING_REASON)


def apply_missing(data: DataConfig, types: dict[str, ColumnType], columns: dict[str, Column],
                  num_rows: int) -> MissingRows:
    """Impute, or mark to skip or fail, the missing values of every scalar and float vector feature of one chunk,
    in place. A float vector's row is missing when an element is NaN: `impute` keeps the row (the model fills
    each NaN element), `skip` and `fail` act on the row. Other vector features are left alone: a missing
    element there is a bad record.
    """
    rows = MissingRows(np.zeros(num_rows, dtype=bool), np.zeros(num_rows, dtype=bool))
    skipped: dict[str, np.ndarray] = {}  # column → its rows missing under `missing: skip`
    for name in list(columns):
        ctype = types[name]
        if ctype.shape and ctype.dtype != DType.FLOAT32:
            continue
        mask = _missing_mask(columns[name], ctype, num_rows)
        if not mask.any():
            continue
        if name == data.label:  # an empty string label is missing too: a bad record, never a class
            _mark(columns[name], mask)
            continue
        policy = data.missing_for(name).missing
        if policy == MissingPolicy.IMPUTE:
            columns[name] = _fill(columns[name], ctype, mask)
            continue
        _mark(columns[name], mask)
        if policy == MissingPolicy.FAIL:
            rows.fail |= mask
        else:
            skipped[name] = mask
    if skipped:
        other = np.zeros(num_rows, dtype=bool)  # rows with a bad value that is not a skipped missing one
        for name, column in columns.items():
            other |= column.bad & ~skipped[name] if name in skipped else column.bad
        for mask in skipped.values():
            rows.skip |= mask
        rows.skip &= ~other
    return rows


def imputation(data: DataConfig, statistics: DatasetStatistics, features: list[str],
               types: dict[str, ColumnType]) -> dict[str, Imputation]:
    """The fill value of every scalar numeric feature under `missing: impute`, from the train split's statistics.

    A column with no value in the train split is filled with `impute_value` (0.0 unless set).
    """
    out = {}
    for name in features:
        ctype = types[name]
        settings = data.missing_for(name)
        if ctype.dtype == DType.STRING or ctype.shape or settings.missing != MissingPolicy.IMPUTE:
            continue
        stats = statistics.feature(name)
        numeric = stats.numeric if stats else None
        fill = settings.impute_value
        if numeric is not None and numeric.count and settings.impute_with != ImputeWith.CONSTANT:
            fill = numeric.mean if settings.impute_with == ImputeWith.MEAN else numeric.quantile(0.5)
        out[name] = Imputation(fill_value=float(fill), indicator=settings.missing_indicator)
    return out
