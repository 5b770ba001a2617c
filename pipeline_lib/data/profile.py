"""A first look at a table, for `tfdag init`: the column types conversion would infer, the task the label implies,
and the columns a model should not take (identifiers, free text), each decision with its reason."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline_lib.config import DataConfig, Task
from pipeline_lib.data.chunk_conversion import plan_conversion
from pipeline_lib.data.coercion import coerce
from pipeline_lib.data.errors import ConversionError
from pipeline_lib.data.manifest import DType
from pipeline_lib.data.readers.registry import open_reader
from pipeline_lib.data.sources import list_source

SAMPLE_ROWS = 10_000
# An integer label with more distinct values than this in the sample is a quantity (a year, a count), not classes.
MAX_CLASSES = 20
# A string column whose values average more bytes than this, and are mostly distinct, is free text.
TEXT_CHARS = 30
_ID_NAME = re.compile(r"(^|_)(id|uuid|guid|key)$|^id_|Id$|ID$")


@dataclass
class TableProfile:
    """What `tfdag init` decided about a table, and why."""

    source: str
    label: str
    sample_rows: int
    sample_file: str
    task: Task
    task_reason: str
    label_values: list[Any]  # the distinct labels seen (classification), at most MAX_CLASSES
    features: list[str] = field(default_factory=list)
    left_out: dict[str, str] = field(default_factory=dict)  # column -> why it is not a feature
    types: dict[str, str] = field(default_factory=dict)  # column -> its inferred type, described


def profile_table(source: str, label: str, storage_options: dict[str, Any] | None = None) -> TableProfile:
    """Read the first SAMPLE_ROWS rows of `source`'s first file and decide the task and the features.

    Raises:
        ConversionError: the source names no readable file, `label` is not one of its columns (listing them), or
            the first file has no rows.
    """
    data = DataConfig(source=source, label=label, storage_options=storage_options or {}, read_chunk_rows=SAMPLE_ROWS)
    fs, files = list_source(data)
    columns = open_reader(fs, files[0], data).available_columns()
    if label not in columns:
        raise ConversionError(f"--label {label!r} is not a column of {files[0].uri}; its columns are {columns}: "
                              "name the column that holds what the model should predict")
    plan, chunks = plan_conversion(fs, files, data)
    try:
        chunk = next(chunks)
    finally:
        chunks.close()
    values = {name: coerce(chunk.columns[name], plan.types[name], files[0].format).values for name in plan.needed}
    task, reason, seen = _task(label, plan.types[label].dtype, values[label])
    profile = TableProfile(source=source, label=label, sample_rows=chunk.num_rows, sample_file=files[0].uri,
                           task=task, task_reason=reason, label_values=seen,
                           types={name: plan.types[name].describe() for name in plan.needed})
    for name in plan.features:
        why = _not_a_feature(name, plan.types[name].dtype, values[name], chunk.num_rows)
        if why:
            profile.left_out[name] = why
        else:
            profile.features.append(name)
    if not profile.features:
        profile.features, profile.left_out = list(plan.features), {}  # keep them all rather than none
    return profile


def _distinct(values: Any) -> list[Any]:
    if isinstance(values, np.ndarray):
        flat = values[~np.isnan(values)] if values.dtype.kind == "f" else values
        return np.unique(flat).tolist()
    return [v for v in pc.unique(values).to_pylist() if v not in (None, b"", "")]


def _task(label: str, dtype: DType, values: Any) -> tuple[Task, str, list[Any]]:
    distinct = _distinct(values)
    if dtype == DType.STRING:
        shown = [v.decode("utf-8", "replace") if isinstance(v, bytes) else v for v in distinct]
        return (Task.CLASSIFICATION, f"{label!r} holds text: {len(distinct)} classes in the sample",
                sorted(shown)[:MAX_CLASSES])
    if dtype == DType.INT64 and len(distinct) <= MAX_CLASSES and min(distinct, default=0) >= 0:
        reason = f"{label!r} holds {len(distinct)} distinct non-negative integers in the sample: classes"
        return Task.CLASSIFICATION, reason, distinct
    if dtype == DType.INT64:
        why = ("negative values" if min(distinct, default=0) < 0
               else f"{len(distinct)} distinct integers (more than {MAX_CLASSES})")
        return Task.REGRESSION, f"{label!r} holds {why} in the sample: a quantity, not classes", []
    return Task.REGRESSION, f"{label!r} holds numbers with fractions: a quantity", []


def _not_a_feature(name: str, dtype: DType, values: Any, num_rows: int) -> str | None:
    if dtype not in (DType.STRING, DType.INT64) or num_rows < 2:
        return None
    if isinstance(values, np.ndarray) and values.ndim > 1:
        return None
    distinct = len(_distinct(values))
    if dtype == DType.STRING:
        array = values.combine_chunks() if isinstance(values, pa.ChunkedArray) else values
        mean_chars = float(pc.mean(pc.binary_length(array)).as_py() or 0.0) if len(array) else 0.0
        if mean_chars > TEXT_CHARS and distinct > 0.5 * num_rows:
            return (f"free text: values of {mean_chars:.0f} bytes on average, {distinct} distinct in "
                    f"{num_rows} rows; the built-in models take categories, not text")
        if distinct == num_rows:
            return f"an identifier: every one of the {num_rows} values in the sample is distinct"
        return None
    if distinct == num_rows and (_ID_NAME.search(name) or _is_counter(values)):
        return f"an identifier: every one of the {num_rows} values in the sample is distinct" + (
            ", counting up by one" if _is_counter(values) else "")
    return None


def _is_counter(values: np.ndarray) -> bool:
    return len(values) > 1 and bool(np.all(np.diff(values) == 1))
