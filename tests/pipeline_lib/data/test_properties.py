"""Conversion proven by properties: generated tables, written by pandas and pyarrow, converted by tfdag and read
back, equal what pyarrow (or json) reads of the same file under tfdag's documented rules.

Generated: int64, float32 (from float64 and float32 columns, float32 ties included), strings (non-ASCII, quotes,
delimiters, tabs, CR, LF and CRLF inside values, "NA"/"null"/"nan" spellings), booleans; for Parquet also int32,
decimals, large strings, dictionary strings, vectors (fixed-size lists, and lists whose length is inferred),
timestamps of every unit and time zone, dates; missing values everywhere, missing labels sometimes; column names
with spaces, punctuation, non-ASCII, leading digits, Python keywords; CSV quoting (QUOTE_MINIMAL, QUOTE_ALL,
QUOTE_NONNUMERIC), LF or CRLF line ends, with or without a final newline and a BOM; JSON float precision and
escaping; 1 to 300 rows read in chunks of 1 to 7 (Parquet row groups of 1 to 50); split seed, eval fraction and
key columns; on_bad_record fail or skip.

Compared, per split and in source order: every value (floats bit for bit, a missing one as NaN, the int64
marker or "" as `data.missing: impute` writes it), the split (the documented hash of each row's converted values),
the schema and label vocabulary, the bad rows (skipped and counted, or the error naming the first one's line or
row, column and reason), statistics.json against numpy (count, missing, min, max, sketch and string counts
exactly; mean and variance within float64 rounding) and the imputation (the train mean). The rules themselves are
modelled in `property_support.py`.

The suite runs each property on a few examples, the same every run (derandomized), so it does not flake. A longer
search, with new random examples each run, is behind a switch, for this file or the whole suite:

    TFDAG_PROPERTY_EXAMPLES=2000 .venv/bin/python -m pytest -q tests/pipeline_lib/data/test_properties.py
    TFDAG_PROPERTY_EXAMPLES=2000 make test

A failure prints the shrunk example and a `@reproduce_failure(...)` line that replays it; add
`--hypothesis-show-statistics` to see how the examples ended (converted, failed on a bad record, ...).
"""

from __future__ import annotations

import tempfile
from decimal import Decimal
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st

from pipeline_lib.config import DataConfig
from pipeline_lib.core import native
from pipeline_lib.data.convert import convert
from pipeline_lib.data.errors import ConversionError
from pipeline_lib.data.split import eval_mask, split_hash
from pipeline_lib.data.statistics import MISSING_INT64, load_statistics
from tests.pipeline_lib.data.conversion_support import read_all
from tests.pipeline_lib.data.property_support import (
    CSV_STYLES,
    PandasTable,
    arrow_tables,
    check_conversion,
    csv_expectation,
    csv_frame,
    examples_from_env,
    jsonl_expectation,
    pandas_tables,
    parquet_expectation,
    read_csv_texts,
    write_csv,
    write_jsonl,
)

# No explain phase: it reruns a failing example hundreds of times (minutes of conversions) to annotate it.
_COMMON = {"deadline": None, "database": None, "phases": [p for p in Phase if p != Phase.explain],
           "suppress_health_check": [HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                     HealthCheck.data_too_large]}
# The suite's profile: few examples, the same every run. The long one (TFDAG_PROPERTY_EXAMPLES): random ones.
settings.register_profile("tfdag-properties", derandomize=True, **_COMMON)
settings.register_profile("tfdag-properties-long", derandomize=False, print_blob=True, **_COMMON)
_PROFILE = settings.get_profile("tfdag-properties-long" if examples_from_env(0) else "tfdag-properties")


def property_settings(default_examples: int) -> settings:
    """This module's profile with `default_examples` examples, or TFDAG_PROPERTY_EXAMPLES of them."""
    return settings(_PROFILE, max_examples=examples_from_env(default_examples))


CHUNK_ROWS = st.integers(1, 7)
SPLITS = st.fixed_dictionaries({"seed": st.integers(0, 2**32), "eval_fraction": st.sampled_from([0.2, 0.5, 0.9])})
ON_BAD_RECORD = st.sampled_from(["fail", "skip"])


def _split_config(draw, split: dict, features: list[str]) -> dict:
    """The split settings, hashing the whole row or (sometimes) one key column."""
    keys = draw(st.one_of(st.none(), st.sampled_from(features).map(lambda name: (name,))))
    return {**split, "key_columns": keys}


def _sanity_check_csv_texts(table: PandasTable, frame: pd.DataFrame, texts: dict[str, list[str]]) -> None:
    """The reference reads back what pandas was given (so a difference below is tfdag's, not the writer's)."""
    for name, kind in table.kinds.items():
        column = frame[name].tolist()
        if kind in ("string", "int", "class") or (name == table.label and kind == "string"):
            want = ["" if pd.isna(v) else str(v) for v in column]
            assert texts[name] == want, name
        else:
            assert [t == "" for t in texts[name]] == [pd.isna(v) for v in column], name


@property_settings(50)
@given(table=pandas_tables(), style=CSV_STYLES, chunk_rows=CHUNK_ROWS, split=SPLITS, on_bad_record=ON_BAD_RECORD,
       data=st.data())
def test_a_csv_converts_to_what_pyarrow_reads_of_it(table, style, chunk_rows, split, on_bad_record, data):
    """Every quoting, line end, final newline or not, a BOM or not, and blocks of 1 to 7 records."""
    with tempfile.TemporaryDirectory() as tmp:
        frame = csv_frame(table, style)
        path = write_csv(frame, Path(tmp) / "table.csv", style)
        names = list(frame.columns)
        _sanity_check_csv_texts(table, frame, read_csv_texts(path, names))
        expected = csv_expectation(path, names, table.label, chunk_rows)
        config = DataConfig(source=path, label=table.label, read_chunk_rows=chunk_rows,
                            split=_split_config(data.draw, split, expected.features), on_bad_record=on_bad_record)
        check_conversion(expected, config, f"{tmp}/out")


@property_settings(30)
@given(table=pandas_tables(), chunk_rows=CHUNK_ROWS, split=SPLITS, on_bad_record=ON_BAD_RECORD,
       double_precision=st.sampled_from([10, 15]), force_ascii=st.booleans(), data=st.data())
def test_json_lines_convert_to_what_json_reads_of_them(table, chunk_rows, split, on_bad_record, double_precision,
                                                       force_ascii, data):
    with tempfile.TemporaryDirectory() as tmp:
        path = write_jsonl(table.frame, Path(tmp) / "table.jsonl", double_precision, force_ascii)
        expected = jsonl_expectation(path, table.label, chunk_rows)
        config = DataConfig(source=path, label=table.label, read_chunk_rows=chunk_rows,
                            split=_split_config(data.draw, split, expected.features), on_bad_record=on_bad_record)
        check_conversion(expected, config, f"{tmp}/out")


@property_settings(40)
@given(table=arrow_tables(), chunk_rows=CHUNK_ROWS, split=SPLITS, on_bad_record=ON_BAD_RECORD, data=st.data())
def test_a_parquet_file_converts_to_what_pyarrow_reads_of_it(table, chunk_rows, split, on_bad_record, data):
    """Integers, booleans, floats with NaN and nulls, decimals, strings (large, dictionary), fixed-length
    vectors, timestamps of every unit and time zone, dates; row groups smaller and larger than a chunk."""
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/table.parquet"
        pq.write_table(table.table, path, row_group_size=table.row_group_size)
        expected = parquet_expectation(path, table.label, chunk_rows, table.row_group_size)
        config = DataConfig(source=path, label=table.label, read_chunk_rows=chunk_rows,
                            split=_split_config(data.draw, split, expected.features), on_bad_record=on_bad_record)
        check_conversion(expected, config, f"{tmp}/out")


@property_settings(20)
@given(table=pandas_tables(), style=CSV_STYLES, chunk_rows=st.lists(CHUNK_ROWS, min_size=2, max_size=2, unique=True),
       seed=st.integers(0, 2**32))
def test_the_block_size_changes_nothing_written_when_it_changes_no_type(table, style, chunk_rows, seed):
    """The same table and seed, read in blocks of two sizes: the same shards byte for byte (so the same split
    and order), the same statistics, wherever both first chunks infer the same types."""
    with tempfile.TemporaryDirectory() as tmp:
        path = write_csv(csv_frame(table, style), Path(tmp) / "table.csv", style)
        results = []
        for k in chunk_rows:
            config = DataConfig(source=path, label=table.label, read_chunk_rows=k, split={"seed": seed},
                                on_bad_record="skip")
            try:
                manifest = convert(config, f"{tmp}/out{k}")
            except ConversionError as error:
                results.append(str(error))
                continue
            results.append((manifest.feature_schema, [s.digest for s in manifest.shards], manifest.num_bad_records,
                            load_statistics(manifest)))
        comparable = all(isinstance(r, tuple) for r in results) and results[0][0] == results[1][0]
        event(f"outcome: {'the same types, compared' if comparable else 'other types or no rows'}")
        if comparable:
            assert results[0][1:3] == results[1][1:3]
            _assert_same_statistics(results[0][3], results[1][3])


def _assert_same_statistics(a, b) -> None:
    """Equal statistics: exactly, but for means and variances, which Chan's merge of other chunks rounds
    differently (within a float64 rounding error of the column's largest value, in either split)."""
    for split in ("train", "eval"):
        assert a.splits[split].num_rows == b.splits[split].num_rows
        for name, left in a.splits[split].features.items():
            right = b.splits[split].features[name]
            if left.numeric is None:
                assert left == right, (split, name)
                continue
            inexact = {"mean", "variance"}
            assert left.numeric.model_dump(exclude=inexact) == right.numeric.model_dump(exclude=inexact), name
            bounds = [abs(v) for s in ("train", "eval") for v in (a.feature(name, s).numeric.min,
                                                                   a.feature(name, s).numeric.max) if v is not None]
            scale = max(bounds, default=0.0)
            for key, tolerance in (("mean", 1e-12 * scale), ("variance", 1e-12 * scale * scale)):
                x, y = getattr(left.numeric, key), getattr(right.numeric, key)
                assert x == y or abs(x - y) <= tolerance, (split, name, key, x, y)


# --- multi-line records across every block boundary -----------------------------------------------------------


def _multi_line_csv(num_records: int, chunk_rows: int) -> tuple[list[str], list[dict]]:
    """Records of 2 or 3 physical lines each (quoted line breaks, LF and CRLF, doubled quotes, delimiters inside
    quotes), their lengths chosen so that no run of `chunk_rows` data lines ends at a record's end: a block cut
    by line count would end inside a quote at every boundary."""
    records, rows, lines_so_far = [], [], 0
    for i in range(num_records):
        num_lines = 2 if chunk_rows == 1 or (lines_so_far + 2) % chunk_rows else 3
        note = f'row {i}, "quoted", a,b\n' + ("middle,\r\n" if num_lines == 3 else "") + f"end {i}"
        end = "\r\n" if i % 2 else "\n"
        x = round(i * 0.37 - 5, 2)
        records.append(f'{i},"{note.replace(chr(34), chr(34) * 2)}",{x},{i % 3}{end}')
        rows.append({"id": i, "note": note, "x": x, "y": i % 3})
        lines_so_far += num_lines
    return records, rows


def _converted_rows(manifest) -> dict[int, tuple]:
    records = read_all(manifest)
    return {int(i): (note.decode(), float(x), int(y))
            for i, note, x, y in zip(records["id"], records["note"], records["x"], records["y"])}


@pytest.mark.parametrize("chunk_rows", range(1, 7))
def test_records_of_several_lines_straddling_every_block_boundary_convert_and_a_bad_row_is_named_by_its_line(
        tmp_path, chunk_rows):
    records, rows = _multi_line_csv(5 * chunk_rows + 3, chunk_rows)
    record_ends = np.cumsum([record.count("\n") for record in records])
    assert all(n >= 2 for n in np.diff(record_ends, prepend=0))
    assert chunk_rows == 1 or not np.any(record_ends % chunk_rows == 0)  # no block of lines ends with a record
    header = "id,note,x,y\n"
    path = tmp_path / "good.csv"
    path.write_text(header + "".join(records), encoding="utf-8", newline="")
    reference = pacsv.read_csv(path, parse_options=pacsv.ParseOptions(newlines_in_values=True))
    assert reference.column("note").to_pylist() == [r["note"] for r in rows]
    manifest = convert(DataConfig(source=str(path), label="y", read_chunk_rows=chunk_rows), str(tmp_path / "good"))
    want = {r["id"]: (r["note"], float(np.float32(r["x"])), r["y"])
            for r in reference.to_pylist()}
    assert manifest.num_bad_records == 0 and _converted_rows(manifest) == want

    # A row with too few fields, itself on two lines, first in the third block, or second.
    for at in (2 * chunk_rows, 2 * chunk_rows + 1):
        bad = '999,"only\ntwo fields"\n'
        path = tmp_path / f"bad{at}.csv"
        path.write_text(header + "".join(records[:at]) + bad + "".join(records[at:]), encoding="utf-8", newline="")
        bad_line = 1 + (header + "".join(records[:at])).count("\n")
        message = rf"bad{at}\.csv line {bad_line} has 2 field\(s\) but the header has 4"
        with pytest.raises(ConversionError, match=message):
            convert(DataConfig(source=str(path), label="y", read_chunk_rows=chunk_rows), str(tmp_path / f"fail{at}"))
        skipped = convert(DataConfig(source=str(path), label="y", read_chunk_rows=chunk_rows, on_bad_record="skip"),
                          str(tmp_path / f"skip{at}"))
        assert skipped.num_bad_records == 1 and _converted_rows(skipped) == want


# --- what the properties found, kept as minimal examples -------------------------------------------------------
# Each was a bug in conversion, fixed since: they stay as regression tests.


def test_a_decimal_converts_to_the_float32_nearest_its_value(tmp_path):
    """Arrow's own decimal → float32 cast is not correctly rounded (decimal128(2, 1) 0.9 gave 0.90000004)."""
    table = pa.table({"d": pa.array([Decimal("0.9"), Decimal("0.1")], pa.decimal128(2, 1)),
                      "y": pa.array([0, 0], pa.int64())})
    pq.write_table(table, tmp_path / "d.parquet")
    manifest = convert(DataConfig(source=str(tmp_path / "d.parquet"), label="y"), str(tmp_path / "out"))
    assert sorted(read_all(manifest)["d"].tolist()) == [np.float32(0.1), np.float32(0.9)]


def test_an_int64_of_the_missing_marker_in_the_source_is_a_bad_value(tmp_path):
    """-2**63 is the number the records keep for a missing int64: a present one was counted as missing and imputed."""
    table = pa.table({"n": pa.array([1, MISSING_INT64], pa.int64()), "y": pa.array([0, 1], pa.int64())})
    pq.write_table(table, tmp_path / "n.parquet")
    with pytest.raises(ConversionError, match=r"n\.parquet row 2, column 'n': value -9223372036854775808 is -2\*\*63"):
        convert(DataConfig(source=str(tmp_path / "n.parquet"), label="y"), str(tmp_path / "fail"))
    manifest = convert(DataConfig(source=str(tmp_path / "n.parquet"), label="y", on_bad_record="skip"),
                       str(tmp_path / "skip"))
    assert manifest.num_bad_records == 1 and read_all(manifest)["n"].tolist() == [1]


def test_a_null_string_label_in_json_lines_is_a_bad_record(tmp_path):
    """It crashed the label vocabulary scan with AttributeError ('NoneType' object has no attribute 'decode')."""
    path = tmp_path / "t.jsonl"
    path.write_text('{"x": 1, "y": "a"}\n{"x": 2, "y": null}\n')
    manifest = convert(DataConfig(source=str(path), label="y", on_bad_record="skip"), str(tmp_path / "out"))
    assert manifest.num_bad_records == 1 and read_all(manifest)["x"].tolist() == [1]


@pytest.fixture(params=["portable", "AVX-512"])
def statistics_loop(request):
    """The statistics' C loop for float32 values: the portable one, or the AVX-512 one where the CPU has it."""
    if native.module is None:
        pytest.skip("the _native extension is not built")
    before = native.module.use_hardware(request.param == "AVX-512")
    try:
        if native.module.statistics_loop() != request.param:
            pytest.skip(f"this CPU cannot run the {request.param} statistics loop")
        yield request.param
    finally:
        native.module.use_hardware(before)


def test_a_split_s_mean_does_not_depend_on_the_other_split_s_values(tmp_path, statistics_loop):
    """A float32 column [1e30, 1.0, 2.0], the first row in train, the others in eval: eval's mean is 1.5 and its
    variance 0.25. The AVX-512 loop took the block's first value, of either split, as a split's origin: eval's
    values cancelled out behind train's 1e30 (mean 0.0, variance 0.0)."""
    ids = np.arange(3, dtype=np.int64)
    seed = next(s for s in range(10_000)
                if eval_mask(split_hash({"id": ids}, s), 0.5).tolist() == [False, True, True])
    table = pa.table({"id": ids, "x": pa.array([1e30, 1.0, 2.0], pa.float32()), "y": pa.array([0, 0, 0], pa.int64())})
    pq.write_table(table, tmp_path / "x.parquet")
    config = DataConfig(source=str(tmp_path / "x.parquet"), label="y",
                        split={"seed": seed, "eval_fraction": 0.5, "key_columns": ["id"]})
    statistics = load_statistics(convert(config, str(tmp_path / "out")))
    eval_x = statistics.feature("x", "eval").numeric
    assert (eval_x.count, eval_x.min, eval_x.max, eval_x.mean, eval_x.variance) == (2, 1.0, 2.0, 1.5, 0.25)


def test_a_timestamp_of_the_int64_missing_marker_is_a_bad_value(tmp_path):
    stamps = pa.array([5, MISSING_INT64], pa.int64()).cast(pa.timestamp("us"))
    pq.write_table(pa.table({"t": stamps, "y": pa.array([0, 1], pa.int64())}), tmp_path / "t.parquet")
    with pytest.raises(ConversionError, match=r"t\.parquet row 2, column 't'"):
        convert(DataConfig(source=str(tmp_path / "t.parquet"), label="y"), str(tmp_path / "out"))


def test_a_json_bool_in_a_float_column_converts_the_same_whatever_its_chunk_holds(tmp_path):
    kept = {}
    for name, tail in {"without_null": "", "with_null": '{"f": null, "y": 1}\n'}.items():
        path = tmp_path / f"{name}.jsonl"
        path.write_text('{"f": 1.5, "y": 0}\n{"f": true, "y": 1}\n' + tail)
        manifest = convert(DataConfig(source=str(path), label="y", on_bad_record="skip"), str(tmp_path / name))
        kept[name] = sorted(v for v in read_all(manifest)["f"].tolist() if not np.isnan(v))
    assert kept["without_null"] == kept["with_null"]


def test_a_bare_carriage_return_in_an_unquoted_field_is_a_bad_record(tmp_path):
    path = tmp_path / "cr.csv"
    path.write_bytes(b"a,y\nx\ry,1\nz,0\n")
    with pytest.raises(ConversionError, match=r"cr\.csv line 2"):
        convert(DataConfig(source=str(path), label="y"), str(tmp_path / "out"))
