"""Coercion: raw chunk values to their column's inferred type, with a mask and a reason for every bad value."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline_lib.config import DataFormat
from pipeline_lib.data.manifest import DType, TimeKind
from pipeline_lib.data.readers.base import MISSING, is_missing
from pipeline_lib.data.schema import ISO_DATE, ColumnType, is_list, is_text
from pipeline_lib.data.statistics import MISSING_INT64
from pipeline_lib.data.tfdag_instants import MICROS_PER_DAY, instant_of

_INT64_RANGE = (-(1 << 63), (1 << 63) - 1)


@dataclass
class Column:
    """Converted values (numpy for numbers, a pyarrow binary array for strings) and which rows were bad."""

    values: Any
    bad: np.ndarray  # bool per row
    reasons: dict[int, tuple[Any, str]]  # row → (value, why), for the rows in `bad`


def arrow_type(ctype: ColumnType) -> pa.DataType:
    """The Arrow type of a column's values (of each element, for a vector column) once coerced to `ctype`."""
    return {DType.INT64: pa.int64(), DType.FLOAT32: pa.float32(), DType.STRING: pa.binary()}[ctype.dtype]


def reader_type(ctype: ColumnType) -> pa.DataType:
    """The Arrow type a reader of text may parse a column to (`Reader.use_types`): `arrow_type`, but text for a
    date or timestamp column, whose ISO 8601 strings coercion parses."""
    return pa.binary() if ctype.time is not None else arrow_type(ctype)


def _cast(values: pa.Array, target: pa.DataType) -> pa.Array:
    # float64 → float32 and int → float may round by design; integer targets stay strict (no truncation).
    if pa.types.is_decimal(values.type) and pa.types.is_floating(target):
        # Arrow's decimal → float32 cast is not correctly rounded (0.9 becomes 0.90000004): through float64, a
        # decimal becomes the float32 nearest its float64, as a float64 column of the same numbers does.
        values = pc.cast(values, pa.float64(), safe=False)
    return pc.cast(values, target, safe=not pa.types.is_floating(target))


def _unconvertible(values: pa.Array, target: pa.DataType) -> list[int]:
    """Indices of the values that do not cast, found by bisection (a few casts per bad value)."""
    try:
        _cast(values, target)
        return []
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OverflowError):
        if len(values) == 1:
            return [0]
    half = len(values) // 2
    return _unconvertible(values.slice(0, half), target) + [half + i for i in _unconvertible(values.slice(half), target)]


class _Marker:
    """Collects bad rows of one column with the first reason each row failed for."""

    def __init__(self, raw: Any, num_rows: int):
        self.raw = raw
        self.bad = np.zeros(num_rows, dtype=bool)
        self.reasons: dict[int, tuple[Any, str]] = {}

    def __call__(self, rows, why: str) -> None:
        for row in np.asarray(rows, dtype=np.int64).tolist():
            if not self.bad[row]:
                self.bad[row] = True
                self.reasons[row] = (_python_value(self.raw[row]), why)

    def column(self, values: Any) -> Column:
        return Column(values, self.bad, self.reasons)


def _python_value(value: Any) -> Any:
    """A bad value as the message shows it: an Arrow scalar as Python's, or as its stored integer where Python has
    none (a timestamp beyond the year 9999)."""
    if not hasattr(value, "as_py"):
        return value
    try:
        return value.as_py()
    except (OverflowError, ValueError):
        return value.value if hasattr(value, "value") else str(value)


def _coerce_arrow(raw: pa.Array, ctype: ColumnType, is_csv: bool) -> Column:
    """Cast a whole Arrow column at once; only when that fails, bisect for the values that do not convert."""
    if isinstance(raw, pa.ChunkedArray):
        raw = raw.combine_chunks()
    num_rows = len(raw)
    mark = _Marker(raw, num_rows)
    # A CSV cell read as text is missing when empty (a column the reader parsed to numbers has no text to compare).
    csv_text = is_csv and ctype.dtype != DType.STRING and is_text(raw.type)
    if raw.null_count or csv_text:
        missing = raw.is_null()
        if csv_text:
            missing = pc.or_(missing, pc.equal(raw, ""))
        mark(np.flatnonzero(missing.to_numpy(zero_copy_only=False)), "is missing")
    if ctype.shape:
        return _coerce_arrow_vector(raw, ctype, mark)
    if ctype.dtype == DType.STRING:
        if not is_text(raw.type):
            if is_list(raw.type) or pa.types.is_struct(raw.type):
                mark(np.arange(num_rows), f"is a {raw.type}, not a string")
                return mark.column(pa.nulls(num_rows, pa.binary()))
            raw = pc.cast(raw, pa.string())
        # Bad rows stay in the array (as they are) and are filtered out before encoding.
        return mark.column(pc.cast(raw, pa.large_binary() if pa.types.is_large_string(raw.type) else pa.binary()))
    if is_list(raw.type) or pa.types.is_struct(raw.type):
        mark(np.arange(num_rows), f"is a {raw.type}, not a {ctype.dtype.value}")
        return mark.column(np.zeros(num_rows, ctype.numpy_dtype))
    target = arrow_type(ctype)
    dtype = ctype.numpy_dtype
    if raw.type == target and not raw.null_count:  # typed as the column already (Parquet, a parsed CSV block)
        return mark.column(raw.to_numpy(zero_copy_only=False))
    while True:
        good_rows = np.flatnonzero(~mark.bad)
        if not len(good_rows):
            return mark.column(np.zeros(num_rows, dtype=dtype))
        subset = raw if len(good_rows) == num_rows else raw.filter(pa.array(~mark.bad))
        try:
            converted = _cast(subset, target)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OverflowError):
            mark(good_rows[_unconvertible(subset, target)],
                 f"cannot be converted to {ctype.dtype.value} (the type inferred from the first chunk)")
            continue
        if len(good_rows) == num_rows:  # the common case: Arrow's buffer, no copy
            return mark.column(converted.to_numpy(zero_copy_only=False).astype(dtype, copy=False))
        out = np.zeros(num_rows, dtype=dtype)  # bad rows stay 0: they are filtered out before encoding
        out[good_rows] = converted.to_numpy(zero_copy_only=False)
        return mark.column(out)


def _coerce_arrow_vector(raw: pa.Array, ctype: ColumnType, mark: _Marker) -> Column:
    num_rows = len(raw)
    (width,) = ctype.shape
    dtype = ctype.numpy_dtype

    def zeros() -> np.ndarray:  # only where some row is bad: the common case returns Arrow's own buffer
        return np.zeros((num_rows, width), dtype=dtype)

    if not is_list(raw.type):
        mark(np.arange(num_rows), f"is a {raw.type}, not a vector of {width} numbers")
        return mark.column(zeros())
    target = arrow_type(ColumnType(ctype.dtype))
    if pa.types.is_fixed_size_list(raw.type) and raw.type.list_size == width and not raw.null_count:
        flat = raw.flatten()  # the common case: every vector present and whole, typed already
        if flat.type == target and not flat.null_count:
            return mark.column(flat.to_numpy(zero_copy_only=False).reshape(-1, width))
    lengths = pc.list_value_length(raw).fill_null(-1).to_numpy(zero_copy_only=False)
    mark(np.flatnonzero(lengths != width), f"is not a vector of length {width}")
    while True:
        good_rows = np.flatnonzero(~mark.bad)
        if not len(good_rows):
            return mark.column(zeros())
        all_good = len(good_rows) == num_rows
        flat = pc.list_flatten(raw if all_good else raw.filter(pa.array(~mark.bad)))
        if flat.null_count:
            inner_null = flat.is_null().to_numpy(zero_copy_only=False).reshape(-1, width).any(axis=1)
            mark(good_rows[inner_null], "holds a missing value")
            continue
        try:
            values = _cast(flat, target)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OverflowError):
            failing = np.unique(np.array(_unconvertible(flat, target), dtype=np.int64) // width)
            mark(good_rows[failing], f"holds a value that cannot be converted to {ctype.dtype.value}")
            continue
        if all_good:  # the common case: the Arrow buffer itself, no copy
            return mark.column(values.to_numpy(zero_copy_only=False).astype(dtype, copy=False).reshape(-1, width))
        out = zeros()
        out[good_rows] = values.to_numpy(zero_copy_only=False).reshape(-1, width)
        return mark.column(out)


def _coerce_numpy(raw: np.ndarray, ctype: ColumnType) -> Column:
    num_rows = raw.shape[0]
    mark = _Marker(raw, num_rows)
    expected_ndim = 2 if ctype.shape else 1
    if raw.ndim != expected_ndim or (ctype.shape and raw.shape[1] != ctype.shape[0]):
        want = f"vectors of length {ctype.shape[0]}" if ctype.shape else "scalars"
        mark(np.arange(num_rows), f"has shape {raw.shape[1:]} per row, but the column holds {want}")
        return mark.column(np.zeros((num_rows, *ctype.shape), np.float32) if ctype.dtype != DType.STRING
                           else pa.nulls(num_rows, pa.binary()))
    if ctype.dtype == DType.STRING:
        if raw.dtype.kind not in "US":
            mark(np.arange(num_rows), f"is not a string (dtype {raw.dtype})")
            return mark.column(pa.nulls(num_rows, pa.binary()))
        items = raw.tolist()
        return mark.column(pa.array(items, pa.binary() if raw.dtype.kind == "S" else pa.string()).cast(pa.binary()))
    if raw.dtype.kind not in "iubf":
        mark(np.arange(num_rows), f"cannot be converted to {ctype.dtype.value} (dtype {raw.dtype})")
        return mark.column(np.zeros((num_rows, *ctype.shape), np.float32))
    if ctype.dtype == DType.FLOAT32:
        return mark.column(raw.astype(np.float32, copy=False))
    if raw.dtype.kind == "f":
        axes = tuple(range(1, raw.ndim))
        integral = np.isfinite(raw) & (raw == np.round(raw)) & (np.abs(raw) < 2.0**63)
        mark(np.flatnonzero(~np.all(integral, axis=axes) if axes else ~integral), "cannot be converted to int64")
        safe = np.where(integral, raw, 0)
        return mark.column(safe.astype(np.int64))
    return mark.column(raw.astype(np.int64))


def _coerce_python(values: list, ctype: ColumnType) -> Column:
    num_rows = len(values)
    bad = np.zeros(num_rows, dtype=bool)
    reasons: dict[int, tuple[Any, str]] = {}
    if ctype.dtype == DType.STRING:
        try:
            strings = pa.array(values, pa.string()).cast(pa.binary())
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError):
            pass
        else:
            for row in np.flatnonzero(strings.is_null().to_numpy(zero_copy_only=False)).tolist():  # a JSON null
                bad[row] = True
                reasons[row] = (None, "is missing")
            return Column(strings, bad, reasons)
        out = []
        for i, value in enumerate(values):
            if isinstance(value, str):
                out.append(value)
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                out.append(json.dumps(value))
            else:
                bad[i] = True
                reasons[i] = (None if value is MISSING else value,
                              "is missing" if is_missing(value) else "is not a string")
                out.append("")
        return Column(pa.array(out, pa.string()).cast(pa.binary()), bad, reasons)
    dtype = ctype.numpy_dtype
    shape = (num_rows, *ctype.shape)
    fast = _python_fast(values, ctype, shape)
    if fast is not None:
        return Column(fast.astype(dtype, copy=False), bad, reasons)
    out = np.zeros(shape, dtype=dtype)
    for i, value in enumerate(values):
        why = _python_problem(value, ctype)
        if why:
            bad[i] = True
            reasons[i] = (None if value is MISSING else value, why)
        else:
            out[i] = value
    return Column(out, bad, reasons)


def _python_fast(values: list, ctype: ColumnType, shape: tuple[int, ...]) -> np.ndarray | None:
    try:
        array = np.asarray(values)
    except (ValueError, OverflowError):
        return None
    if array.shape != shape:
        return None
    if ctype.dtype == DType.INT64:
        return array if array.dtype.kind in "iub" else None
    return array if array.dtype.kind in "iubf" else None


def _python_problem(value: Any, ctype: ColumnType) -> str | None:
    if is_missing(value):
        return "is missing"
    items = value
    if ctype.shape:
        if not isinstance(value, list) or len(value) != ctype.shape[0]:
            return f"is not a vector of length {ctype.shape[0]}"
    else:
        items = [value]
    for item in items:
        if item is None:
            return "holds a missing value"
        if ctype.dtype == DType.INT64:
            if not isinstance(item, int) or not (_INT64_RANGE[0] <= item <= _INT64_RANGE[1]):
                return "cannot be converted to int64"
        elif not isinstance(item, (int, float)):  # a bool is a number, 0 or 1, as inference and numpy take it
            return "cannot be converted to float32"
    return None


# Microseconds per unit of an Arrow timestamp (ns: divided instead).
_MICROS_PER = {"s": 1_000_000, "ms": 1_000, "us": 1}


def _time_values(raw: pa.Array, ctype: ColumnType, mark: _Marker) -> np.ndarray:
    """An Arrow timestamp or date array as int64 instants: floored to whole microseconds (ns), or to whole days
    (a timestamp in a date column); a value beyond the int64 range of the unit is a bad value."""
    storage = pa.int32() if pa.types.is_date32(raw.type) else pa.int64()
    ints = raw.view(storage).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
    if pa.types.is_date32(raw.type):
        days = ints
    elif pa.types.is_date64(raw.type):  # milliseconds, whole days by the format's rule
        days = np.floor_divide(ints, 86_400_000)
    else:
        unit = raw.type.unit
        if unit == "ns":
            micros = np.floor_divide(ints, 1_000)
        else:
            limit = np.iinfo(np.int64).max // _MICROS_PER[unit]
            out_of_range = (ints > limit) | (ints < -limit)  # not np.abs: it overflows at -2**63
            if out_of_range.any():
                mark(np.flatnonzero(out_of_range), f"is beyond the int64 range of microseconds (a {raw.type})")
            micros = np.where(out_of_range, 0, ints) * _MICROS_PER[unit]
        return np.floor_divide(micros, MICROS_PER_DAY) if ctype.time == TimeKind.DATE else micros
    if ctype.time == TimeKind.DATE:
        return days
    limit = np.iinfo(np.int64).max // MICROS_PER_DAY
    out_of_range = (days > limit) | (days < -limit)
    if out_of_range.any():
        mark(np.flatnonzero(out_of_range), "is beyond the int64 range of microseconds")
    return np.where(out_of_range, 0, days) * MICROS_PER_DAY


def _parse_instants(texts: list[Any], ctype: ColumnType, mark: _Marker, skip: np.ndarray) -> np.ndarray:
    """Values that are ISO 8601 strings (`instant_of`) as int64 instants; the `skip` rows (missing) stay 0."""
    out = np.zeros(len(texts), np.int64)
    why = f"cannot be converted to {ctype.time.value} (the type inferred from the first chunk)"
    seen: dict[Any, int | None] = {}  # dates repeat: each distinct string is parsed once
    bad = []
    for row, text in enumerate(texts):
        if skip[row]:
            continue
        if text in seen:
            instant = seen[text]
        else:
            instant = None
            if isinstance(text, bytes | str):
                string = text.decode("utf-8", "replace") if isinstance(text, bytes) else text
                # A date column takes dates only: a time of day would be dropped without a word.
                if ctype.time != TimeKind.DATE or ISO_DATE.fullmatch(string):
                    try:
                        instant = instant_of(string, ctype.time.value)
                    except ValueError:
                        pass
            seen[text] = instant
        if instant is None:
            bad.append(row)
        else:
            out[row] = instant
    if bad:
        mark(bad, why)
    return out


def _decoded(raw: pa.Array | pa.ChunkedArray) -> pa.Array:
    """A dictionary-encoded Arrow column as the plain array of its values (a dictionary<string> is strings)."""
    if isinstance(raw, pa.ChunkedArray):
        raw = raw.combine_chunks()
    return raw.dictionary_decode() if pa.types.is_dictionary(raw.type) else raw


def _coerce_time(raw: Any, ctype: ColumnType) -> Column:
    """A date or timestamp column as int64 instants (`FeatureSpec.time`): Arrow timestamps and dates of any unit
    and time zone by their value (UTC), ISO 8601 strings (CSV, JSONL, Arrow text, numpy) by `instant_of`."""
    if isinstance(raw, pa.Array | pa.ChunkedArray):
        raw = _decoded(raw)
    num_rows = len(raw)
    mark = _Marker(raw, num_rows)
    if isinstance(raw, np.ndarray) and raw.dtype.kind == "M":  # NPZ datetime64: floored to the microsecond
        missing = np.isnat(raw)
        mark(np.flatnonzero(missing), "is missing")
        micros = raw.astype("datetime64[us]").astype(np.int64)
        values = np.floor_divide(micros, MICROS_PER_DAY) if ctype.time == TimeKind.DATE else micros
        return mark.column(np.where(missing, 0, values).reshape(num_rows))
    if isinstance(raw, np.ndarray | list):
        texts = raw.tolist() if isinstance(raw, np.ndarray) else raw
        missing = np.array([is_missing(v) or v == "" for v in texts], dtype=bool)
        mark(np.flatnonzero(missing), "is missing")
        return mark.column(_parse_instants(texts, ctype, mark, missing))
    missing = raw.is_null()
    if is_text(raw.type):
        missing = pc.or_(missing, pc.equal(pc.binary_length(raw), 0))  # an empty cell, in CSV or not
    missing = missing.to_numpy(zero_copy_only=False)
    mark(np.flatnonzero(missing), "is missing")
    if pa.types.is_timestamp(raw.type) or pa.types.is_date(raw.type):
        return mark.column(_time_values(raw, ctype, mark))
    if is_text(raw.type):
        return mark.column(_parse_instants(raw.to_pylist(), ctype, mark, missing))
    mark(np.flatnonzero(~missing), f"is a {raw.type}, not a {ctype.time.value} (ISO 8601 text or a "
                                   f"{ctype.time.value} type)")
    return mark.column(np.zeros(num_rows, np.int64))


def coerce(raw: Any, ctype: ColumnType, fmt: DataFormat) -> Column:
    """One column of a chunk converted to `ctype`, whatever its reader (numpy arrays, Python lists or Arrow)."""
    if ctype.time is not None:
        column = _coerce_time(raw, ctype)
        _refuse_missing_marker(column)
        return column
    if isinstance(raw, pa.Array | pa.ChunkedArray) and pa.types.is_dictionary(raw.type):
        raw = _decoded(raw)
    if isinstance(raw, np.ndarray):
        column = _coerce_numpy(raw, ctype)
    elif isinstance(raw, list):
        column = _coerce_python(raw, ctype)
    else:
        column = _coerce_arrow(raw, ctype, is_csv=fmt == DataFormat.CSV)
    if ctype.dtype == DType.INT64:
        _refuse_missing_marker(column)
    return column


def _refuse_missing_marker(column: Column) -> None:
    """An int64 value of -2**63 is a bad value: the records keep it for a missing int64 (`MISSING_INT64`), so it
    would be read back as missing and imputed."""
    values = column.values
    hits = values == MISSING_INT64
    if not hits.any():
        return
    rows = hits.reshape(len(values), -1).any(axis=1) & ~column.bad
    why = "is -2**63, the int64 the records keep for a missing value; store the column as float, or leave it empty"
    for row in np.flatnonzero(rows).tolist():
        column.bad[row] = True
        column.reasons[row] = (MISSING_INT64, why)

