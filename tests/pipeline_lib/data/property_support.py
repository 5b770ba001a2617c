"""Support of the conversion property tests: generated tables, their writers, and tfdag's documented rules as a
model that predicts, from what pyarrow (or json) reads of the written file, every converted value, bad row,
split and statistic.

The model is written from the rules (README "Configuration reference" and "Know the data", `schema.py`,
`coercion.py`, `missing.py`, `split.py`, `statistics.py`), not from the conversion's code paths:
- a CSV cell is text; its column's type comes from the first chunk's non-empty cells (int64 if Arrow casts them
  all to int64, else float32 if to float64, else string), and a later cell that does not cast is a bad value;
- a JSON column's type is its first chunk's JSON type (float32 if a number there has a fraction); a Parquet
  column's type is its Arrow type (a vector's length the first chunk's most common one);
- missing: an empty CSV cell of a numeric column, a null, an empty string, a NaN in a float column (CSV text that
  Arrow reads as NaN, "nan" or "NaN", included; "NA" or "null" in a numeric column cannot be converted); written
  as NaN, the int64 marker -2**63 or "" (`data.missing: impute`), and a present int64 of -2**63 is a bad value;
- numbers are stored as Arrow reads the text (CSV, to float32 directly) or as float32 of the float64 value
  (Parquet, JSON, decimals);
- a missing or negative (int64) label is a bad record; a string label is its index in the sorted vocabulary.
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
from hypothesis import event
from hypothesis import strategies as st

from pipeline_lib.config import DataConfig
from pipeline_lib.data.convert import convert
from pipeline_lib.data.errors import ConversionError
from pipeline_lib.data.manifest import DType, TimeKind
from pipeline_lib.data.split import eval_mask, hashed_columns, split_hash
from pipeline_lib.data.statistics import MISSING_INT64, SKETCH_SHIFT, load_statistics
from tests.pipeline_lib.data.conversion_support import read_all

EXAMPLES_ENV = "TFDAG_PROPERTY_EXAMPLES"
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


def bucket_key(values: np.ndarray) -> np.ndarray:
    """The reference sketch key of each float32 value (`data.statistics`): its top bits, negated (minus one) for
    negative values."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    magnitude = ((bits & np.uint32(0x7FFFFFFF)) >> np.uint32(SKETCH_SHIFT)).astype(np.int64)
    return np.where(bits >> np.uint32(31) == 1, -magnitude - 1, magnitude)


def examples_from_env(default: int) -> int:
    """`default`, or the positive integer in TFDAG_PROPERTY_EXAMPLES (the long run's examples per property)."""
    raw = os.environ.get(EXAMPLES_ENV, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{EXAMPLES_ENV} ({raw!r}) must be a positive integer, e.g. {EXAMPLES_ENV}=2000; "
                         "unset it for the suite's default")
    return value


# --- generated values -----------------------------------------------------------------------------------------

# Column names: spaces, punctuation (the delimiter and the quote too), non-ASCII, leading digits, Python keywords.
# No control characters: a line break in a header name is legal CSV, but no schema or model needs one.
_NAME_CHARS = st.characters(blacklist_categories=("Cs", "Cc"))
NAMES = st.one_of(
    st.text(_NAME_CHARS, min_size=1, max_size=10),
    st.sampled_from(["class", "def", "None", "lambda", "1st", "2", "a b", " lead", "x,y", 'say "hi"', "ü", "名前",
                     "id", "y", "label"]),
)

# Text values: line breaks (LF, CR, CRLF), the delimiter, the quote, tabs and spaces, non-ASCII, and spellings
# other readers take for missing ("NA", "null", "nan") or for numbers.
_TEXT_CHARS = st.one_of(st.characters(blacklist_categories=("Cs", "Cc")), st.sampled_from(["\n", "\r", "\t"]))
TEXTS = st.one_of(
    st.text(_TEXT_CHARS, max_size=8),
    st.sampled_from(["", "NA", "null", "nan", "None", "\r\n", "a\r\nb", "1", "-7", "2.5", " 3", "a,b", '"', '""q"',
                     "ünï☃", "e\u0301", "\u2028"]),
)
LABEL_TEXTS = st.sampled_from(["a", "b", "Zürich", "名", "x y", "1", ""])


def _float32_midpoint(value: float) -> float:
    """The float64 half way between a float32 and the next one up: rounding it to float32 is a tie."""
    low = np.float32(value)
    high = np.nextafter(low, np.float32(np.inf))
    return (float(low) + float(high)) / 2


FLOAT64S = st.one_of(
    st.floats(min_value=-1e30, max_value=1e30, allow_nan=False),
    st.floats(width=32, allow_nan=False, allow_infinity=False).filter(lambda f: abs(f) < 1e30).map(_float32_midpoint),
    st.sampled_from([0.1, -0.0, 1e-310, 123456789.123, 16777217.0, 0.30000000000000004]),
)
FLOAT32S = st.floats(width=32, allow_nan=False, allow_infinity=False)
INTS = st.one_of(st.integers(INT64_MIN, INT64_MAX), st.integers(-1000, 1000))  # -2**63: a bad value


@st.composite
def column_values(draw, values: st.SearchStrategy, num_rows: int, missing: bool = True,
                  first_present: bool = False) -> list:
    """`num_rows` values drawn from a small pool of distinct ones (None: missing), so that tables of hundreds of
    rows stay cheap to draw and shrink to a few values. `first_present`: the first row has a value (types are
    inferred from the first chunk, and a column with no value there has none)."""
    pool = draw(st.lists(values, min_size=1, max_size=6))
    share = draw(st.sampled_from([0.0, 0.2, 0.6])) if missing else 0.0
    rnd = draw(st.randoms(use_true_random=False))
    out = [None if share and rnd.random() < share else rnd.choice(pool) for _ in range(num_rows)]
    if first_present:
        out[0] = pool[0]
    return out


NUM_ROWS = st.one_of(st.integers(1, 12), st.integers(1, 60), st.integers(61, 300))


# --- pandas tables (CSV and JSON Lines) -----------------------------------------------------------------------

PANDAS_KINDS = ("int", "float64", "float32", "string", "bool")
LABEL_KINDS = ("class", "string", "regression")


@dataclass
class PandasTable:
    frame: pd.DataFrame
    label: str
    kinds: dict[str, str]  # column → kind (PANDAS_KINDS, or LABEL_KINDS for the label)


def _pandas_column(kind: str, values: list) -> pd.Series:
    if kind in ("int", "class"):
        return pd.Series(values, dtype="Int64")
    if kind in ("float64", "regression"):
        return pd.Series([np.nan if v is None else v for v in values], dtype=np.float64)
    if kind == "float32":
        return pd.Series([np.nan if v is None else v for v in values], dtype=np.float32)
    if kind == "bool":
        return pd.Series(values, dtype="boolean")
    return pd.Series(values, dtype=object)


_KIND_VALUES = {"int": INTS, "float64": FLOAT64S, "float32": FLOAT32S, "string": TEXTS, "bool": st.booleans(),
                "class": st.integers(0, 3), "regression": FLOAT64S}


@st.composite
def pandas_tables(draw, num_rows: st.SearchStrategy = NUM_ROWS) -> PandasTable:
    n = draw(num_rows)
    names = draw(st.lists(NAMES, min_size=2, max_size=6, unique=True))
    label = names[-1]
    kinds = {name: draw(st.sampled_from(PANDAS_KINDS)) for name in names[:-1]}
    kinds[label] = draw(st.sampled_from(LABEL_KINDS))
    # A missing label is a bad record: most tables have none, so most of them convert under on_bad_record: fail.
    label_missing = draw(st.sampled_from([False, False, True]))
    first_present = draw(st.sampled_from([True, True, False]))
    columns = {}
    for name, kind in kinds.items():
        values = LABEL_TEXTS if (name == label and kind == "string") else _KIND_VALUES[kind]
        cells = draw(column_values(values, n, missing=name != label or label_missing, first_present=first_present))
        columns[name] = _pandas_column(kind, cells)
    # Columns in a drawn order, the label among them.
    order = draw(st.permutations(names))
    return PandasTable(pd.DataFrame({name: columns[name] for name in order}), label, {n: kinds[n] for n in order})


@dataclass(frozen=True)
class CsvStyle:
    quoting: int
    lineterminator: str
    final_newline: bool
    bom: bool


CSV_STYLES = st.builds(CsvStyle, st.sampled_from([csv.QUOTE_MINIMAL, csv.QUOTE_ALL, csv.QUOTE_NONNUMERIC]),
                       st.sampled_from(["\n", "\r\n"]), st.booleans(), st.booleans())


def csv_frame(table: PandasTable, style: CsvStyle) -> pd.DataFrame:
    """The frame as it can be written to RFC 4180 CSV in `style`: Python's csv writer leaves a bare CR unquoted
    under QUOTE_MINIMAL when the line terminator is LF, which no RFC 4180 reader reads back (CR is not allowed
    in an unquoted field): there, a bare CR becomes CRLF, which the writer quotes."""
    if style.quoting != csv.QUOTE_MINIMAL or style.lineterminator != "\n":
        return table.frame
    frame = table.frame.copy()
    for name in table.kinds:
        if frame[name].dtype == object:
            frame[name] = frame[name].map(lambda v: re.sub("\r(?!\n)", "\r\n", v) if isinstance(v, str) else v)
    return frame


def write_csv(frame: pd.DataFrame, path: Path, style: CsvStyle) -> str:
    frame.to_csv(path, index=False, quoting=style.quoting, lineterminator=style.lineterminator,
                 encoding="utf-8-sig" if style.bom else "utf-8")
    if not style.final_newline:
        data = path.read_bytes()
        path.write_bytes(data[: -len(style.lineterminator.encode())])
    return str(path)


def write_jsonl(frame: pd.DataFrame, path: Path, double_precision: int, force_ascii: bool) -> str:
    frame.to_json(path, orient="records", lines=True, double_precision=double_precision, force_ascii=force_ascii)
    return str(path)


# --- Parquet tables -------------------------------------------------------------------------------------------

PARQUET_KINDS = ("int64", "int32", "bool", "float64", "float32", "decimal", "string", "large_string", "dictionary",
                 "vector_f32", "vector_i64", "timestamp", "date")
# The largest value of each unit whose microseconds fit an int64 (not -2**63 µs: see
# test_a_timestamp_of_the_int64_missing_marker_is_a_bad_value).
_TIME_UNITS = {"s": 10**12, "ms": 10**15, "us": INT64_MAX, "ns": INT64_MAX}


@dataclass
class ArrowTable:
    table: pa.Table
    label: str
    row_group_size: int


@st.composite
def _arrow_column(draw, kind: str, n: int, missing: bool, first_present: bool) -> pa.Array:
    def values(strategy):
        return draw(column_values(strategy, n, missing, first_present))

    if kind in ("int64", "class"):
        return pa.array(values(INTS if kind == "int64" else st.integers(0, 3)), pa.int64())
    if kind == "int32":
        return pa.array(values(st.integers(-(1 << 31), (1 << 31) - 1)), pa.int32())
    if kind == "bool":
        return pa.array(values(st.booleans()), pa.bool_())
    if kind in ("float64", "regression"):  # NaN is a value here, beside null
        return pa.array(values(st.one_of(FLOAT64S, st.just(math.nan))), pa.float64())
    if kind == "float32":
        return pa.array(values(st.one_of(FLOAT32S, st.just(math.nan))), pa.float32())
    if kind == "decimal":
        precision = draw(st.integers(1, 18))
        scale = draw(st.integers(0, precision))
        bound = Decimal(10) ** (precision - scale) - Decimal(10) ** -scale
        return pa.array(values(st.decimals(-bound, bound, places=scale, allow_nan=False, allow_infinity=False)),
                        pa.decimal128(precision, scale))
    if kind in ("string", "large_string", "dictionary", "label_string"):
        array = pa.array(values(LABEL_TEXTS if kind == "label_string" else TEXTS),
                         pa.large_string() if kind == "large_string" else pa.string())
        return array.dictionary_encode() if kind == "dictionary" else array
    if kind in ("vector_f32", "vector_i64"):
        element_type = pa.float32() if kind == "vector_f32" else pa.int64()
        element = st.one_of(FLOAT32S, st.just(math.nan)) if kind == "vector_f32" else INTS
        if draw(st.booleans()):  # fixed-size lists; no null row: pyarrow 25 cannot read one back from Parquet
            width = draw(st.integers(1, 4))
            vectors = draw(column_values(st.lists(element, min_size=width, max_size=width), n, False))
            return pa.array(vectors, pa.list_(element_type, width))
        # Lists of any length: the first chunk's most common one is the vector's, rows of another are bad.
        return pa.array(values(st.lists(element, max_size=4)), pa.list_(element_type))
    if kind == "timestamp":
        unit = draw(st.sampled_from(sorted(_TIME_UNITS)))
        tz = draw(st.sampled_from([None, "UTC", "Europe/Zurich"]))
        limit = _TIME_UNITS[unit]
        ints = values(st.one_of(st.integers(-limit, limit), st.integers(-10**6, 10**6)))
        return pa.array(ints, pa.int64()).cast(pa.timestamp(unit, tz=tz))
    if kind == "date":
        return pa.array(values(st.integers(-(10**6), 10**6)), pa.int32()).cast(pa.date32())
    raise AssertionError(kind)


@st.composite
def arrow_tables(draw, num_rows: st.SearchStrategy = NUM_ROWS) -> ArrowTable:
    n = draw(num_rows)
    names = draw(st.lists(NAMES, min_size=2, max_size=7, unique=True))
    label = names[-1]
    label_kind = draw(st.sampled_from(["class", "label_string", "regression"]))
    label_missing = draw(st.sampled_from([False, False, True]))
    first_present = draw(st.sampled_from([True, True, False]))
    columns = {name: draw(_arrow_column(draw(st.sampled_from(PARQUET_KINDS)), n, True, first_present))
               for name in names[:-1]}
    columns[label] = draw(_arrow_column(label_kind, n, label_missing, first_present))
    order = draw(st.permutations(names))
    row_group_size = draw(st.integers(1, 50))
    return ArrowTable(pa.table({name: columns[name] for name in order}), label, row_group_size)


# --- the model of the rules -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Type:
    dtype: DType
    shape: tuple[int, ...] = ()
    time: TimeKind | None = None


@dataclass
class Expected:
    """What converting a table must give by the documented rules: the rows kept (`on_bad_record: skip`), or the
    error naming the first bad one (`fail`), or an error before any row (`error`)."""

    unit: str  # "line" or "row"
    features: list[str]
    label: str
    types: dict[str, Type]
    values: dict[str, list]  # column → per row: the record's value (a missing one in its imputed form)
    missing: dict[str, list[int]]  # column → per row: its missing values (elements, for a vector)
    bad: list[tuple[str, str] | None]  # per row: (the first bad column in the reader's order, why)
    positions: list[int]  # per row: its line (CSV, JSONL) or row (Parquet)
    vocabulary_texts: list[Any] = field(default_factory=list)  # string label: each row's text (None: bad there)
    error: str | None = None  # a ConversionError before any row is converted: a fragment of its message

    @property
    def kept(self) -> list[int]:
        return [i for i, why in enumerate(self.bad) if why is None]


def _arrow_cast(texts: list[str], target: pa.DataType) -> list[Any]:
    """Each text cast by Arrow to `target` (as pyarrow.csv reads a typed column); None where Arrow refuses it."""
    try:
        return pc.cast(pa.array(texts, pa.string()), target, safe=False).to_pylist()
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        pass
    out = []
    for text in texts:
        try:
            out.append(pc.cast(pa.array([text], pa.string()), target, safe=False)[0].as_py())
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            out.append(None)
    return out


def _csv_type(first_texts: list[str]) -> Type:
    present = [t for t in first_texts if t != ""]
    if not present:
        return Type(DType.STRING)
    if None not in _arrow_cast(present, pa.int64()):
        return Type(DType.INT64)
    if None not in _arrow_cast(present, pa.float64()):
        return Type(DType.FLOAT32)
    return Type(DType.STRING)


def read_csv_texts(path: str, names: list[str]) -> dict[str, list[str]]:
    """Every cell of an RFC 4180 CSV as pyarrow.csv reads it when no value is null and every column is text."""
    table = pacsv.read_csv(
        path, read_options=pacsv.ReadOptions(use_threads=False),
        parse_options=pacsv.ParseOptions(newlines_in_values=True),
        convert_options=pacsv.ConvertOptions(column_types={n: pa.string() for n in names},
                                             strings_can_be_null=False, quoted_strings_can_be_null=False))
    assert table.column_names == names
    return {n: table.column(n).to_pylist() for n in names}


def _marker_rule(values: list, missing: list[int], bad: list) -> None:
    """An int64 value of -2**63 (a present one: not the marker of a missing value) is a bad value: the records
    keep that number for a missing int64."""
    for i, value in enumerate(values):
        if bad[i] is None and not missing[i] and INT64_MIN in (value if isinstance(value, tuple) else (value,)):
            bad[i] = "is -2**63, the int64 the records keep for a missing value"


def _label_rules(ltype: Type, values: list, missing: list[int], bad: list) -> None:
    """A missing label is a bad record; a negative int64 label too (classes are 0..n-1)."""
    for i, value in enumerate(values):
        if bad[i] is not None:
            continue
        if missing[i]:
            bad[i] = "is missing"
        elif ltype.dtype == DType.INT64 and value < 0:
            bad[i] = "is a negative class label"


def _finish(unit, names, label, types, values, missing, column_bad, positions,
            no_value: set[str] = frozenset()) -> Expected:
    """Rows' first bad column in the reader's order (the features, then the label) and the label's rules.

    `no_value`: columns whose type cannot be inferred from the first chunk: the first of them in that order is
    named by the error."""
    features = [n for n in names if n != label]
    num_rows = len(positions)
    bad: list[tuple[str, str] | None] = [None] * num_rows
    for name in names:
        if types[name].dtype == DType.INT64 and types[name].time is None:
            _marker_rule(values[name], missing[name], column_bad[name])
    _label_rules(types[label], values[label], missing[label], column_bad[label])
    for i in range(num_rows):
        for name in [*features, label]:
            if column_bad[name][i] is not None:
                bad[i] = (name, column_bad[name][i])
                break
    vocabulary_texts = []
    if types[label].dtype == DType.STRING:
        vocabulary_texts = [None if column_bad[label][i] else values[label][i] for i in range(num_rows)]
    error = next((f"column {n!r} of " for n in [*features, label] if n in no_value), None)
    return Expected(unit, features, label, types, values, missing, bad, positions, vocabulary_texts, error)


def _empty_column(num_rows):
    return [None] * num_rows


def csv_expectation(path: str, names: list[str], label: str, chunk_rows: int) -> Expected:
    """tfdag's rules applied to the cells pyarrow reads from the CSV at `path`."""
    texts = read_csv_texts(path, names)
    num_rows = len(texts[names[0]])
    types, values, missing, column_bad = {}, {}, {}, {}
    for name in names:
        ctype = _csv_type(texts[name][:chunk_rows])
        types[name] = ctype
        column, missed, bad = [], [], _empty_column(num_rows)
        if ctype.dtype == DType.STRING:
            column = [t.encode() for t in texts[name]]
            missed = [int(t == "") for t in texts[name]]
        else:
            target = pa.int64() if ctype.dtype == DType.INT64 else pa.float32()
            cast = _arrow_cast(texts[name], target)
            for i, (text, value) in enumerate(zip(texts[name], cast)):
                if text == "":
                    column.append(MISSING_INT64 if ctype.dtype == DType.INT64 else np.float32(np.nan))
                    missed.append(1)
                    continue
                if value is None:
                    bad[i] = f"cannot be converted to {ctype.dtype.value}"
                    value = 0
                # Text Arrow reads as NaN ("nan", "NaN", "NAN") is a NaN in a float column: missing, as in
                # Parquet, where "NA" or "null" cannot be converted.
                is_nan = ctype.dtype == DType.FLOAT32 and math.isnan(value)
                missed.append(int(is_nan))
                column.append(int(value) if ctype.dtype == DType.INT64 else np.float32(np.nan if is_nan else value))
        values[name], missing[name], column_bad[name] = column, missed, bad
    # A record starts on the line after the previous record's last line (line breaks inside quotes included).
    positions, line = [], 2
    for i in range(num_rows):
        positions.append(line)
        line += 1 + sum(texts[name][i].count("\n") for name in names)
    return _finish("line", names, label, types, values, missing, column_bad, positions)


def _json_kind(value: Any) -> str:
    if isinstance(value, (bool, int)):
        return "int"
    return {float: "float", str: "str", list: "list"}.get(type(value), type(value).__name__)


def jsonl_expectation(path: str, label: str, chunk_rows: int) -> Expected:
    """tfdag's rules applied to the objects json reads from the JSON Lines file at `path`."""
    lines = Path(path).read_bytes().split(b"\n")
    rows = [(number, json.loads(line)) for number, line in enumerate(lines, start=1) if line.strip()]
    names = list(rows[0][1])
    num_rows = len(rows)
    types, values, missing, column_bad = {}, {}, {}, {}
    no_value = set()
    for name in names:
        cells = [obj.get(name) for _, obj in rows]
        present = [v for v in cells[:chunk_rows] if v is not None]
        if not present:
            no_value.add(name)
            types[name] = Type(DType.STRING)
        else:
            kinds = Counter("number" if _json_kind(v) in ("int", "float") else _json_kind(v) for v in present)
            assert len(kinds) == 1, kinds  # pandas writes one JSON type per column
            if "number" in kinds:
                has_float = any(_json_kind(v) == "float" for v in present)
                types[name] = Type(DType.FLOAT32 if has_float else DType.INT64)
            else:
                types[name] = Type(DType.STRING)
        ctype = types[name]
        column, missed, bad = [], [], _empty_column(num_rows)
        for i, value in enumerate(cells):
            if ctype.dtype == DType.STRING:
                text = value if isinstance(value, str) else ""
                if value is not None and not isinstance(value, str):
                    text = json.dumps(value)
                column.append(text.encode())
                missed.append(int(text == ""))
            elif value is None:
                column.append(MISSING_INT64 if ctype.dtype == DType.INT64 else np.float32(np.nan))
                missed.append(1)
            elif ctype.dtype == DType.INT64:
                missed.append(0)
                if isinstance(value, int) and INT64_MIN <= value <= INT64_MAX:
                    column.append(int(value))
                else:
                    column.append(0)
                    bad[i] = "cannot be converted to int64"
            else:
                missed.append(0)
                column.append(np.float32(value))
        values[name], missing[name], column_bad[name] = column, missed, bad
    return _finish("line", names, label, types, values, missing, column_bad, [number for number, _ in rows],
                   no_value=no_value)


def _micros(raw: int, unit: str) -> int:
    return raw // 1000 if unit == "ns" else raw * {"s": 10**6, "ms": 10**3, "us": 1}[unit]


def parquet_expectation(path: str, label: str, chunk_rows: int, row_group_size: int) -> Expected:
    """tfdag's rules applied to the columns pyarrow reads from the Parquet file at `path`."""
    table = pq.read_table(path)
    names = table.column_names
    num_rows = table.num_rows
    first_rows = min(chunk_rows, row_group_size, num_rows)
    types, values, missing, column_bad = {}, {}, {}, {}
    no_value = set()
    for name in names:
        array = table.column(name).combine_chunks()
        arrow_type = array.type.value_type if pa.types.is_dictionary(array.type) else array.type
        column, missed, bad = [], [], _empty_column(num_rows)
        if pa.types.is_fixed_size_list(arrow_type) or pa.types.is_list(arrow_type):
            is_float = pa.types.is_floating(arrow_type.value_type)
            # The most common length in the first chunk (ties: the one seen first).
            lengths = Counter(len(cell) for cell in array.slice(0, first_rows).to_pylist() if cell is not None)
            width = max(lengths, key=lengths.get) if lengths else 0
            if not width:  # no length to infer, or empty lists
                no_value.add(name)
            ctype = Type(DType.FLOAT32 if is_float else DType.INT64, (width,))
            for i, cell in enumerate(array.to_pylist()):
                if cell is None and is_float:  # missing whole: every element NaN, each one missing
                    column.append(tuple(np.float32(np.nan) for _ in range(width)))
                    missed.append(width)
                elif cell is None or len(cell) != width:
                    # An int64 vector is never imputed: a missing one is a bad record, as one of another length.
                    column.append(tuple(0 for _ in range(width)))
                    missed.append(0)
                    bad[i] = "is missing" if cell is None else f"is not a vector of length {width}"
                elif is_float:
                    column.append(tuple(np.float32(v) for v in cell))
                    missed.append(sum(math.isnan(v) for v in cell))
                else:
                    column.append(tuple(int(v) for v in cell))
                    missed.append(0)
        elif pa.types.is_timestamp(arrow_type) or pa.types.is_date(arrow_type):
            is_date = pa.types.is_date(arrow_type)
            ctype = Type(DType.INT64, time=TimeKind.DATE if is_date else TimeKind.TIMESTAMP)
            raw = array.cast(pa.int32() if is_date else pa.int64()).to_pylist()  # the stored integers
            for value in raw:
                missed.append(int(value is None))
                column.append(MISSING_INT64 if value is None else
                              value if is_date else _micros(value, arrow_type.unit))
        elif pa.types.is_integer(arrow_type) or pa.types.is_boolean(arrow_type):
            ctype = Type(DType.INT64)
            for value in array.to_pylist():
                missed.append(int(value is None))
                column.append(MISSING_INT64 if value is None else int(value))
        elif pa.types.is_floating(arrow_type):
            ctype = Type(DType.FLOAT32)
            for value in array.to_pylist():
                is_missing = value is None or math.isnan(value)
                missed.append(int(is_missing))
                column.append(np.float32(np.nan) if is_missing else np.float32(value))
        elif pa.types.is_decimal(arrow_type):  # the float32 nearest the decimal's float64
            ctype = Type(DType.FLOAT32)
            for value in array.to_pylist():
                missed.append(int(value is None))
                column.append(np.float32(np.nan) if value is None else np.float32(float(value)))
        else:
            ctype = Type(DType.STRING)
            for value in array.to_pylist():
                text = (value or "").encode()
                missed.append(int(text == b""))
                column.append(text)
        types[name] = ctype
        values[name], missing[name], column_bad[name] = column, missed, bad
    return _finish("row", names, label, types, values, missing, column_bad, list(range(1, num_rows + 1)),
                   no_value=no_value)


# --- the check ------------------------------------------------------------------------------------------------


def _array(expected: Expected, name: str, rows: list[int]):
    """The column's values for `rows` as conversion holds them (numpy numbers, Arrow binary strings)."""
    ctype = expected.types[name]
    column = expected.values[name]
    if ctype.dtype == DType.STRING:
        return pa.array([column[i] for i in rows], pa.binary())
    dtype = np.int64 if ctype.dtype == DType.INT64 else np.float32
    return np.array([column[i] for i in rows], dtype=dtype).reshape(len(rows), *ctype.shape)


def _same_floats(got: np.ndarray, want: np.ndarray) -> bool:
    """The same float32 bits (-0.0 is not 0.0), or both NaN."""
    got, want = got.astype(np.float32).reshape(-1), want.astype(np.float32).reshape(-1)
    return bool(np.all((np.isnan(got) & np.isnan(want)) | (got.view(np.uint32) == want.view(np.uint32))))


def expect_bad_record_error(expected: Expected, config: DataConfig, output_root: str) -> None:
    """`on_bad_record: fail`: the first bad row in file order is named by its line or row, column and reason."""
    first = next(i for i, why in enumerate(expected.bad) if why is not None)
    column, why = expected.bad[first]
    with pytest.raises(ConversionError) as raised:
        convert(config, output_root)
    message = str(raised.value)
    assert message.startswith("bad record: ")
    assert f" {expected.unit} {expected.positions[first]}, column {column!r}: value " in message, message
    assert why in message, message


def check_conversion(expected: Expected, config: DataConfig, output_root: str):
    """Convert and compare every split's rows, the split itself, the schema and statistics.json with `expected`.

    Returns the manifest, or None where conversion must fail (and did, with the expected message).
    """
    if expected.error is not None:
        event("outcome: no type inferred from the first chunk")
        with pytest.raises(ConversionError, match=re.escape(expected.error)):
            convert(config, output_root)
        return None
    num_bad = sum(why is not None for why in expected.bad)
    if num_bad and config.on_bad_record == "fail":
        event("outcome: fails on a bad record")
        expect_bad_record_error(expected, config, output_root)
        return None
    kept = expected.kept
    if not kept:
        event("outcome: every row bad")
        with pytest.raises(ConversionError, match="produced no rows"):
            convert(config, output_root)
        return None
    event(f"outcome: converted, {'some' if num_bad else 'no'} bad rows skipped")
    manifest = convert(config, output_root)
    assert manifest.num_bad_records == num_bad
    names = [*expected.features, expected.label]

    # The schema: every feature's type, the label's encoding.
    schema = manifest.feature_schema
    assert [f.name for f in schema.features] == expected.features
    for spec in schema.features:
        want = expected.types[spec.name]
        assert (spec.dtype, tuple(spec.shape), spec.time) == (want.dtype, want.shape, want.time), spec
    label_type = expected.types[expected.label]
    vocabulary = None
    if label_type.dtype == DType.STRING:
        vocabulary = sorted({t.decode() for t in expected.vocabulary_texts if t})
        assert schema.label_vocabulary == tuple(vocabulary)
        assert schema.num_classes == len(vocabulary)
    elif label_type.dtype == DType.INT64:
        assert schema.num_classes == max(expected.values[expected.label][i] for i in kept) + 1
        assert schema.label_vocabulary is None
    else:
        assert schema.num_classes is None and schema.label.dtype == DType.FLOAT32

    # The split: the documented hash of each row's converted values and the seed.
    columns = {n: _array(expected, n, kept) for n in names}
    hashed = hashed_columns(config.split, expected.features, expected.label)
    to_eval = eval_mask(split_hash({n: columns[n] for n in hashed}, config.split.seed), config.split.eval_fraction)
    rows = {"eval": [kept[i] for i in np.flatnonzero(to_eval)], "train": [kept[i] for i in np.flatnonzero(~to_eval)]}

    statistics = load_statistics(manifest)
    for split, split_rows in rows.items():
        assert manifest.num_records(split) == len(split_rows), split
        assert statistics.splits[split].num_rows == len(split_rows), split
        records = read_all(manifest, split) if split_rows else None
        for name in names:
            want = _array(expected, name, split_rows)
            if records is not None:
                got = records[name]
                if name == expected.label and vocabulary is not None:
                    labels = [vocabulary.index(v.decode()) for v in want.to_pylist()]
                    assert got.tolist() == labels, (split, name)
                elif expected.types[name].dtype == DType.STRING:
                    assert got.tolist() == want.to_pylist(), (split, name)
                elif expected.types[name].dtype == DType.INT64:
                    assert got.reshape(want.shape).tolist() == want.tolist(), (split, name)
                else:
                    assert _same_floats(got, want), (split, name, got, want)
            _check_statistics(statistics.splits[split].features[name], expected, name, split_rows, want,
                              _scale(_array(expected, name, kept)))
    _check_imputation(statistics, expected, rows["train"])
    return manifest


def _scale(values) -> float:
    """The largest magnitude of a numeric column's present values (0 for strings or none)."""
    if isinstance(values, pa.Array):
        return 0.0
    present = values.reshape(-1)
    present = present[present != MISSING_INT64] if values.dtype == np.int64 else present[~np.isnan(present)]
    flat = present.astype(np.float64)
    return float(np.max(np.abs(flat))) if flat.size else 0.0


def _check_statistics(stats, expected: Expected, name: str, rows: list[int], want, column_scale: float) -> None:
    """count, missing, min, max exactly; mean and variance within a float64 rounding error of the column's
    largest value (both splits': see test_a_split_s_mean_does_not_depend_on_the_other_split_s_values)."""
    where = f"statistics of {name!r}"
    ctype = expected.types[name]
    assert stats.dtype == ctype.dtype, where
    num_missing = sum(expected.missing[name][i] for i in rows)
    if ctype.dtype == DType.STRING:
        texts = want.to_pylist()
        counts = Counter(t.decode() for t in texts if t)
        assert (stats.string.count, stats.string.missing) == (sum(counts.values()), num_missing), where
        assert stats.string.values == dict(counts) and not stats.string.truncated, where
        return
    flat = want.reshape(-1)
    present = flat[~np.isnan(flat)] if ctype.dtype == DType.FLOAT32 else flat[flat != MISSING_INT64]
    numeric = stats.numeric
    assert (numeric.count, numeric.missing) == (len(present), flat.size - len(present)), where
    assert numeric.missing == num_missing, where
    if not len(present):
        assert numeric.min is None and numeric.mean is None, where
        return
    assert (numeric.min, numeric.max) == (float(present.min()), float(present.max())), where
    as_float = present.astype(np.float64)
    scale = column_scale
    mean, variance = float(np.mean(as_float)), float(np.var(as_float))
    # float64 sums in another order: a rounding error relative to the largest value (squared for the variance).
    assert math.isclose(numeric.mean, mean, rel_tol=1e-6, abs_tol=1e-12 * scale), (where, numeric.mean, mean)
    assert math.isclose(numeric.variance, variance, rel_tol=1e-6, abs_tol=1e-12 * scale * scale), (
        where, numeric.variance, variance)
    assert numeric.sketch == dict(Counter(bucket_key(present).tolist())), where


def _check_imputation(statistics, expected: Expected, train_rows: list[int]) -> None:
    """`missing: impute` fills a scalar number with its train mean (0 where the train split has none)."""
    numeric = [n for n in expected.features
               if expected.types[n].dtype != DType.STRING and not expected.types[n].shape]
    assert sorted(statistics.imputation) == sorted(numeric)
    for name in numeric:
        train = statistics.feature(name, "train").numeric
        fill = train.mean if train.count else 0.0
        assert statistics.imputation[name].fill_value == pytest.approx(fill), name
        assert statistics.imputation[name].indicator is False
