"""The C loops (`_native.c`) give the bytes and hashes of the pure-Python path, their absence is never silent, and
local shards are durable."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import sysconfig
from pathlib import Path

import crc32c
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from pipeline_lib.config import DataConfig
from pipeline_lib.core import native
from pipeline_lib.data.accumulators import NumericAccumulator, add_numeric_splits
from pipeline_lib.data.convert import convert
from pipeline_lib.data.framing import encode_tfrecords
from pipeline_lib.data.split import split_hash
from pipeline_lib.data.statistics import MISSING_INT64
from pipeline_lib.data.tfrecord_writer import TFRecordFileWriter
from tests.pipeline_lib.data.encoding_support import columns_of_every_dtype


@pytest.fixture
def built():
    """The extension module; the project's install builds it (gcc is on every machine we test on)."""
    assert native.module is not None, "pipeline_lib.core._native is not built: reinstall with a C compiler (make install)"
    return native.module


def _pure_python(monkeypatch):
    monkeypatch.setattr(native, "module", None)


@pytest.mark.parametrize("hardware", [True, False])
def test_crc32c_matches_the_reference_library_with_and_without_the_cpu_instruction(built, hardware):
    previous = built.use_hardware(hardware)
    try:
        with open("/proc/cpuinfo") as cpuinfo:  # the CRC32 instruction is SSE 4.2's (this project's machines: x86-64)
            has_instruction = platform.machine() == "x86_64" and "sse4_2" in cpuinfo.read().split()
        assert built.crc_loop() == ("hardware" if hardware and has_instruction else "table")
        assert native.describe().startswith(f"C (_native), {built.crc_loop()} CRC32C")
        rng = np.random.default_rng(1)
        for size in [0, 1, 7, 8, 9, 15, 16, 17, 63, 64, 65, 1000, 4099]:
            data = rng.integers(0, 256, size=size, dtype=np.uint8).tobytes()
            assert built.crc32c(data) == crc32c.crc32c(data), size
    finally:
        built.use_hardware(previous)


@pytest.mark.parametrize("num_rows", [1, 37, 9000])
def test_native_framing_writes_the_bytes_of_the_python_loop(built, monkeypatch, num_rows):
    columns = columns_of_every_dtype(num_rows)
    fixed = {"small_int": columns["small_int"], "float_vec": columns["float_vec"], "float": columns["float"]}
    native_ragged, native_fixed = encode_tfrecords(columns), encode_tfrecords(fixed)
    _pure_python(monkeypatch)
    python_ragged, python_fixed = encode_tfrecords(columns), encode_tfrecords(fixed)
    assert np.array_equal(native_fixed.offsets, python_fixed.offsets)
    assert bytes(native_fixed.view()) == bytes(python_fixed.view())
    assert np.array_equal(native_ragged.offsets, python_ragged.offsets)
    assert bytes(native_ragged.view()) == bytes(python_ragged.view())


@pytest.mark.parametrize("num_rows", [1, 37, 9000])
def test_encoding_in_a_given_row_order_writes_the_records_of_those_rows_with_and_without_the_extension(
        built, monkeypatch, num_rows):
    columns = columns_of_every_dtype(num_rows, seed=5)
    fixed = {"small_int": columns["small_int"], "float_vec": columns["float_vec"], "float": columns["float"]}
    rng = np.random.default_rng(num_rows)
    order = np.concatenate([rng.permutation(num_rows), rng.integers(0, num_rows, size=5)])  # repeats allowed
    results = []
    for use_native in (True, False):
        if not use_native:
            _pure_python(monkeypatch)
        for cols in (fixed, columns):
            whole, ordered = encode_tfrecords(cols), encode_tfrecords(cols, order=order)
            assert ordered.records() == [whole.record(i) for i in order.tolist()]
            results.append(bytes(ordered.view()))
    assert results[:2] == results[2:]


def test_native_framing_rejects_buffers_that_are_not_records(built):
    template = np.zeros(20, dtype=np.uint8)
    column = np.zeros((5, 4), dtype=np.uint8)
    with pytest.raises(ValueError, match="not a whole number"):
        built.frame_rows(np.zeros(30, dtype=np.uint8), template, [(12, column)], None)
    with pytest.raises(ValueError, match="not a framed record"):
        built.frame_offsets(np.zeros(100, dtype=np.uint8), np.array([0, 10], dtype=np.int64))
    with pytest.raises(TypeError, match="writable"):
        built.frame_rows(b"\0" * 100, template, [(12, column)], None)
    out = np.zeros(100, dtype=np.uint8)
    with pytest.raises(ValueError, match="outside the payload"):
        built.frame_rows(out, template, [(14, column)], None)  # 14 + 4 > 20 - 4
    with pytest.raises(ValueError, match="contiguous rows"):
        built.frame_rows(out, template, [(12, np.zeros((5, 8), dtype=np.uint8)[:, ::2])], None)
    with pytest.raises(IndexError, match="order\\[2\\] = 5"):
        built.frame_rows(out, template, [(12, column)], np.array([0, 1, 5, 2, 3], dtype=np.int64))
    with pytest.raises(ValueError, match="6 rows for 5 output records"):
        built.frame_rows(out, template, [(12, np.zeros((6, 4), dtype=np.uint8))], None)
    with pytest.raises(IndexError, match="outside 0..4"):
        encode_tfrecords({"a": np.arange(5)}, order=np.array([5]))


def test_native_split_hash_equals_the_numpy_loop(built, monkeypatch):
    columns = columns_of_every_dtype(5000, seed=3)
    values = {name: columns[name] for name in ("small_int", "int", "float", "float_vec", "int_vec", "string")}
    odd = np.random.default_rng(0).normal(size=(5000, 3)).astype(np.float32)  # an odd float32 width: one word each
    values["odd"] = odd
    with_native = split_hash(values, seed=11)
    _pure_python(monkeypatch)
    assert np.array_equal(with_native, split_hash(values, seed=11))
    assert not np.array_equal(with_native, split_hash(values, seed=12))


def test_native_string_words_reject_strings_outside_their_data(built):
    out = np.empty(2, np.uint64)
    built.string_words(b"abcdef", np.array([0, 2], np.int64), np.array([2, 4], np.int64), out)
    assert out.tolist() == [crc32c.crc32c(b"ab") | 2 << 32, crc32c.crc32c(b"cdef") | 4 << 32]
    with pytest.raises(ValueError, match=r"string 1 \(5 bytes at 2\) is not inside the 6 bytes"):
        built.string_words(b"abcdef", np.array([0, 2], np.int64), np.array([2, 5], np.int64), out)
    with pytest.raises(ValueError, match="one 8-byte value per string"):
        built.string_words(b"abcdef", np.array([0, 2], np.int64), np.array([2], np.int64), out)


def _numeric_columns(num_rows: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(num_rows)
    floats = (rng.normal(size=num_rows) * 10.0 ** rng.integers(-3, 4, size=num_rows)).astype(np.float32)
    floats[rng.random(num_rows) < 0.1] = np.nan
    ints = rng.integers(-10**12, 10**12, size=num_rows)
    ints[rng.random(num_rows) < 0.1] = MISSING_INT64
    vectors = rng.normal(size=(num_rows, 3)).astype(np.float32)
    vectors[rng.random((num_rows, 3)) < 0.05] = np.nan
    columns = {"floats": floats, "ints": ints, "vectors": vectors, "no_values": np.full(num_rows, np.nan, np.float32)}
    # Far from 0, and a jump after the first third: the AVX-512 loop sums deviations from the mean so far.
    columns["far_from_zero"] = (1e4 + rng.normal(size=num_rows) * 1e-2).astype(np.float32)
    columns["jump"] = (np.where(np.arange(num_rows) < num_rows // 3, 1e6, 0.0)
                       + rng.normal(size=num_rows) * 1e-3).astype(np.float32)
    # Rows of 8 values or more take the C loop's per-row path; rows longer than its block of 2,048 values span blocks.
    for width in (8, 32, 2051)[: 3 if num_rows < 100 else 2]:
        wide = rng.normal(size=(num_rows, width)).astype(np.float32)
        wide[rng.random((num_rows, width)) < 0.05] = np.nan
        columns[f"vectors_{width}"] = wide
    wide_ints = rng.integers(-1000, 1000, size=(num_rows, 8))
    wide_ints[rng.random((num_rows, 8)) < 0.05] = MISSING_INT64
    columns["int_vectors_8"] = wide_ints
    return columns


@pytest.mark.parametrize("hardware", [True, False])  # float32 values: the AVX-512 loop where the CPU has it, and not
@pytest.mark.parametrize("split_kind", ["rows", "all_train", "all_eval"])
@pytest.mark.parametrize("num_rows", [1, 37, 9000])
def test_native_numeric_statistics_equal_the_numpy_path_and_numpy_itself(built, monkeypatch, split_kind,
                                                                        num_rows, hardware):
    previous = built.use_hardware(hardware)
    try:
        assert built.statistics_loop() == ("AVX-512" if hardware and _vector_statistics_can_run() else "portable")
        _statistics_equal_numpys(built, monkeypatch, split_kind, num_rows)
    finally:
        built.use_hardware(previous)


def _vector_statistics_can_run() -> bool:
    """Whether the statistics' AVX-512 loop should run here: built by GCC 12 or later on x86-64, and the CPU has it."""
    if platform.machine() != "x86_64" or sysconfig.get_config_var("CC").split()[0] != "gcc":
        return False
    version = subprocess.run(["gcc", "-dumpversion"], capture_output=True, text=True, check=True).stdout
    with open("/proc/cpuinfo") as cpuinfo:
        flags = next(line for line in cpuinfo if line.startswith("flags")).split()
    return int(version.split(".")[0]) >= 12 and {"avx512f", "avx512vl", "avx512dq", "avx512bw", "popcnt"} <= set(flags)


def _statistics_equal_numpys(built, monkeypatch, split_kind, num_rows):
    to_eval = np.random.default_rng(1).random(num_rows) < 0.3
    split = {"rows": to_eval, "all_train": 0, "all_eval": 1}[split_kind]
    rows = {"rows": to_eval, "all_train": np.zeros(num_rows, bool), "all_eval": np.ones(num_rows, bool)}[split_kind]
    results = []
    for use_native in (True, False):
        if not use_native:
            _pure_python(monkeypatch)
        accumulators = {}
        for name, values in _numeric_columns(num_rows).items():
            train, eval_ = NumericAccumulator(), NumericAccumulator()
            for chunk in (slice(0, num_rows // 2), slice(num_rows // 2, num_rows)):  # two chunks, merged
                add_numeric_splits(train, eval_, values[chunk], split if isinstance(split, int) else split[chunk])
            accumulators[name] = (train.result(), eval_.result())
        results.append(accumulators)
    fast, slow = results
    for name, values in _numeric_columns(num_rows).items():
        for which, is_eval in ((0, False), (1, True)):
            a, b = fast[name][which], slow[name][which]
            assert (a.count, a.missing, a.min, a.max, a.sketch) == (b.count, b.missing, b.min, b.max, b.sketch), name
            chosen = values[rows == is_eval].reshape(-1)
            missing = np.isnan(chosen) if chosen.dtype.kind == "f" else chosen == MISSING_INT64
            present = chosen[~missing].astype(np.float64)
            assert (a.count, a.missing) == (len(present), int(missing.sum())), name
            if len(present):
                assert (a.min, a.max) == (present.min(), present.max())
                assert a.mean == pytest.approx(present.mean(), rel=1e-12, abs=1e-12)
                assert a.variance == pytest.approx(present.var(), rel=1e-9, abs=1e-12)
                assert b.variance == pytest.approx(present.var(), rel=1e-9, abs=1e-12)


def test_native_numeric_statistics_reject_what_they_cannot_read(built):
    keys = np.zeros(1 << 14, dtype=np.int64)
    with pytest.raises(TypeError, match="float32 or int64"):
        built.numeric_statistics(np.zeros(4, dtype=np.float64), 0, keys, keys.copy(), 18)
    with pytest.raises(ValueError, match="do not make 3 rows"):
        built.numeric_statistics(np.zeros(4, dtype=np.float32), np.zeros(3, bool), keys, keys.copy(), 18)
    with pytest.raises(ValueError, match="16384 entries"):
        built.numeric_statistics(np.zeros(4, dtype=np.float32), 0, keys[:10], keys.copy(), 18)


@pytest.mark.parametrize("fmt", ["parquet", "csv"])
def test_conversion_writes_identical_shards_with_and_without_the_extension(built, tmp_path, monkeypatch, fmt):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3000, 5)).astype(np.float32)
    n, label = rng.integers(-1000, 1000, size=3000), rng.integers(0, 3, size=3000)
    if fmt == "parquet":
        table = pa.table({"x": pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), 5), "n": n, "label": label})
        source = tmp_path / "rows.parquet"
        pq.write_table(table, source)
    else:
        source = _numbers_csv(tmp_path / "rows.csv", x, n, label)
    data = DataConfig(source=str(source), label="label", target_shard_mb=0.05, read_chunk_rows=1000)
    fast = convert(data, str(tmp_path / "native"))
    _pure_python(monkeypatch)
    slow = convert(data, str(tmp_path / "python"))
    assert [(s.path, s.num_records, s.digest) for s in fast.shards] == [
        (s.path, s.num_records, s.digest) for s in slow.shards
    ]
    assert fast.feature_schema == slow.feature_schema
    assert len(fast.shards) > 2


def _numbers_csv(path: Path, x: np.ndarray, n: np.ndarray, label: np.ndarray) -> Path:
    """Numbers only, so the C loop parses the blocks (its types guessed for the first)."""
    columns = {**{f"x{j}": np.round(x[:, j], 4) for j in range(x.shape[1])}, "n": n, "label": label}
    path.write_text(",".join(columns) + "\n" + "\n".join(",".join(str(v) for v in row)
                                                      for row in zip(*columns.values())) + "\n")
    return path


# A process where the extension does not import, as after an install without a C compiler (None in sys.modules makes
# the import fail), imports the conversion path several ways and converts twice, recording every log record.
_WITHOUT_THE_EXTENSION = """
import importlib, json, logging, sys
sys.modules["pipeline_lib.core._native"] = None
records = []
handler = logging.Handler()
handler.emit = records.append
logging.getLogger().addHandler(handler)
from pipeline_lib.config import DataConfig
from pipeline_lib.core import native
from pipeline_lib.data.convert import convert
import pipeline_lib.data.framing, pipeline_lib.data.split, pipeline_lib.data.accumulators
importlib.import_module("pipeline_lib.core.native")
source, out = sys.argv[1:]
data = DataConfig(source=source, label="label", target_shard_mb=0.05, read_chunk_rows=1000)
shards = [[(s.path, s.num_records, s.digest) for s in convert(data, f"{out}/{i}").shards] for i in range(2)]
print(json.dumps({"module": repr(native.module), "describe": native.describe(), "shards": shards,
                  "warnings": [r.getMessage() for r in records if "_native" in r.getMessage()]}))
"""


def test_a_process_without_the_built_extension_warns_once_and_converts_to_the_same_shards(built, tmp_path):
    rng = np.random.default_rng(2)
    source = _numbers_csv(tmp_path / "rows.csv", rng.normal(size=(2000, 3)).astype(np.float32),
                          rng.integers(-1000, 1000, size=2000), rng.integers(0, 3, size=2000))
    out = subprocess.run([sys.executable, "-c", _WITHOUT_THE_EXTENSION, str(source), str(tmp_path / "python")],
                         cwd=Path(__file__).resolve().parents[3], capture_output=True, text=True, timeout=300,
                         check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.splitlines()[-1])
    assert (result["module"], result["describe"]) == ("None", "pure Python (the _native extension is not built)")
    [warning] = result["warnings"]  # once, though imported several ways and converted twice
    for text in ("pipeline_lib.core._native did not load", "much slower", "C compiler", "Python headers",
                 "make install", "pip install -e ."):
        assert text in warning, warning
    data = DataConfig(source=str(source), label="label", target_shard_mb=0.05, read_chunk_rows=1000)
    fast = [[s.path, s.num_records, s.digest] for s in convert(data, str(tmp_path / "native")).shards]
    assert len(fast) > 2 and result["shards"] == [fast, fast]


def _plain_numbers(rng, count: int, integers: bool) -> list[str]:
    """Numbers as CSV files write them: integers up to 18 digits, or decimals with up to 7 significant digits,
    some with an exponent, some with trailing zeros, signs and zeros of both kinds."""
    if integers:
        values = rng.integers(-10**18 + 1, 10**18, size=count) // 10 ** rng.integers(0, 18, count)
        return ["0", "-0", "-1", "999999999999999999"] + [str(int(v)) for v in values]
    values = []
    for _ in range(count):
        whole = str(rng.choice([0, rng.integers(0, 10), rng.integers(0, 1000)]))
        text = ("-" if rng.random() < 0.4 else "") + whole
        if rng.random() < 0.8:
            text += "." + "".join(rng.choice(list("0123456789"), size=rng.integers(1, 5)))
        if rng.random() < 0.15:
            text += rng.choice(["e", "E"]) + rng.choice(["", "+", "-"]) + str(rng.integers(0, 7))
        values.append(text)
    return ["0", "-0", "0.0", "-0.0", "16777216", "1.00000000", "100000000000.0e-10", "1e10"] + values


def test_native_csv_parse_reads_plain_values_to_the_values_and_types_arrow_gives(built):
    """The C loop's float32 values are bitwise Arrow's (read_csv to float32, and the cast of the text that
    coercion does), its text Arrow's strings; a column's guessed kind is int64 exactly when Arrow casts all its
    text to int64."""
    rng = np.random.default_rng(3)
    for trial in range(40):
        count = int(rng.integers(1, 3000))
        text_values = ["".join(rng.choice(list(" \tab-Z.0;"), size=rng.integers(0, 6))) for _ in range(count)]
        columns = {"i": _plain_numbers(rng, count, integers=True), "skipped": [f"s{k}" for k in range(count)],
                   "f": _plain_numbers(rng, count, integers=False), "s": text_values}
        count = min(len(v) for v in columns.values())
        columns = {name: values[:count] for name, values in columns.items()}
        end = "\r\n" if trial % 2 else "\n"
        text = "".join(",".join(row) + end for row in zip(*columns.values())).encode()
        assert built.parse_csv_block(text, ",", b"?-?-", [], count) == b"q-f-"
        assert built.parse_csv_block(text, ",", b"?-??", [], count) is False  # text is no number
        ints, floats = np.empty(count, np.int64), np.empty(count, np.float32)
        offsets, data = np.empty(count + 1, np.int32), np.empty(len(text), np.uint8)
        assert built.parse_csv_block(text, ",", b"q-fs", [ints, floats, offsets, data], count) == b"q-fs"
        arrow = pacsv.read_csv(pa.BufferReader(text),
                               read_options=pacsv.ReadOptions(column_names=list(columns)),
                               convert_options=pacsv.ConvertOptions(column_types={"i": pa.int64(), "f": pa.float32(),
                                                                                  "s": pa.string()},
                                                                    strings_can_be_null=False))
        strings = pa.Array.from_buffers(pa.binary(), count, [None, pa.py_buffer(offsets), pa.py_buffer(data)])
        assert strings.to_pylist() == pc.cast(arrow.column("s"), pa.binary()).to_pylist()
        assert strings.to_pylist() == [v.encode() for v in columns["s"]]
        assert np.array_equal(arrow.column("i").to_numpy(), ints)
        assert np.array_equal(arrow.column("f").to_numpy().view(np.int32), floats.view(np.int32))
        cast = pc.cast(pa.array(columns["f"]), pa.float32()).to_numpy()
        assert np.array_equal(cast.view(np.int32), floats.view(np.int32))
        # The integers read as float32 where they have at most 7 digits (else not a plain float32 form).
        small = pa.array([v for v in columns["i"] if len(v.lstrip("-")) <= 7] or ["1"])
        as_float = np.empty(len(small), np.float32)
        small_text = "\n".join(small.to_pylist()).encode() + b"\n"
        assert built.parse_csv_block(small_text, ",", b"f", [as_float], len(small))
        assert np.array_equal(pc.cast(small, pa.float32()).to_numpy().view(np.int32), as_float.view(np.int32))


@pytest.mark.parametrize("text, kinds", [
    (b"caf\xc3\xa9\n", b"s"), (b"1.5\n", b"q"), (b"16777217\n", b"f"), (b"123456789.5\n", b"f"), (b"1e11\n", b"f"),
    (b"0.00000000001\n", b"f"), (b"1234567890123456789\n", b"q"),  # values no plain form holds
    (b"inf\n", b"f"), (b"nan\n", b"f"), (b".5\n", b"f"), (b"5.\n", b"f"), (b"+1\n", b"q"), (b"01\n", b"q"),
    (b" 1\n", b"q"), (b"1 \n", b"f"), (b"\n", b"q"), (b"1e\n", b"f"), (b"1e1000\n", b"f"), (b"0x10\n", b"q"),
    (b"1,2\n", b"q"), (b"1\n", b"q-"), (b"1\r2\n", b"q"), (b"1\n\n", b"q"), (b"1", b"q"), (b'"1"\n', b"q"),
])
def test_native_csv_parse_leaves_what_is_not_plain_to_arrow(built, text, kinds):
    """A value in no plain form, a line with another number of fields, a blank line, a lone carriage return, a
    missing last newline or a quote: False (the reader then gives the block to Arrow)."""
    buffers = [np.empty(2, np.int64 if kind == ord("q") else np.float32) for kind in kinds if kind in b"fq"]
    if kinds == b"s":
        buffers = [np.empty(2, np.int32), np.empty(len(text), np.uint8)]
    assert built.parse_csv_block(text, ",", kinds, buffers, 1) is False


def test_native_csv_parse_guesses_float32_where_integers_and_decimals_mix(built):
    assert built.parse_csv_block(b"2\n1.5\n", ",", b"?", [], 2) == b"f"
    assert built.parse_csv_block(b"2\n-3\n", ",", b"?", [], 2) == b"q"
    # 123456789 has an int64 form but no plain float32 one (more than 2^24), 2.5 only a float32 one.
    assert built.parse_csv_block(b"123456789\n2.5\n", ",", b"?", [], 2) is False


def test_native_csv_parse_rejects_arguments_it_cannot_use(built):
    with pytest.raises(ValueError, match="one-byte delimiter"):
        built.parse_csv_block(b"1\n", ",,", b"q", [np.empty(1, np.int64)], 1)
    with pytest.raises(ValueError, match="not one of"):
        built.parse_csv_block(b"1\n", ",", b"x", [], 1)
    with pytest.raises(ValueError, match="1 output buffers where the kinds need 2"):
        built.parse_csv_block(b"1,2\n", ",", b"qq", [np.empty(1, np.int64)], 1)
    with pytest.raises(ValueError, match="fewer than the 16 it needs for 2 lines"):
        built.parse_csv_block(b"1\n2\n", ",", b"q", [np.empty(1, np.int64)], 2)
    with pytest.raises(ValueError, match="output 1 holds 2 bytes, fewer than the 3 it needs"):
        built.parse_csv_block(b"ab\n", ",", b"s", [np.empty(2, np.int32), np.empty(2, np.uint8)], 1)
    with pytest.raises(BufferError):
        built.parse_csv_block(b"1\n", ",", b"q", [b"12345678"], 1)


def test_local_shards_and_their_directories_are_fsynced_before_the_manifest(tmp_path, monkeypatch):
    """A crash after manifest.json lands must not leave it naming a short shard: every shard file, the
    directories that received them, and then the manifest are fsynced, in that order (a spy on os.fsync)."""
    events: list[str] = []
    real_fsync = os.fsync

    def spy(fd):
        events.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    rng = np.random.default_rng(0)
    source = tmp_path / "rows.npz"
    np.savez(source, x=rng.normal(size=(4000, 8)).astype(np.float32), label=rng.integers(0, 2, size=4000))
    manifest = convert(DataConfig(source=str(source), label="label", target_shard_mb=0.1), str(tmp_path / "out"))
    dataset_dir = os.path.join(str(tmp_path / "out"), "data", manifest.fingerprint)
    shard_syncs = [i for i, path in enumerate(events) if "/.staging-" in path and "/part-" in path]
    assert len(shard_syncs) == len(manifest.shards) >= 3
    manifest_sync = next(i for i, path in enumerate(events) if path.endswith(".json.tmp-" + str(os.getpid()))
                         and "manifest" in path)
    directory_syncs = [i for i, path in enumerate(events) if path in (os.path.join(dataset_dir, "train"),
                                                                       os.path.join(dataset_dir, "eval"))]
    assert len(directory_syncs) == 2
    assert max(shard_syncs) < min(directory_syncs) < manifest_sync


def test_durable_writes_hand_each_large_block_to_the_device_as_it_is_written(built, tmp_path, monkeypatch):
    """start_writeback (sync_file_range) is a hint: the test checks it is asked for exactly the blocks written.

    It is the plain (direct=False) durable path: durable files are written with O_DIRECT by default.
    """
    calls = []
    real = built.start_writeback

    def spy(fd, offset, nbytes):
        calls.append((offset, nbytes))
        return real(fd, offset, nbytes)

    monkeypatch.setattr(built, "start_writeback", spy)
    rng = np.random.default_rng(6)
    framed = encode_tfrecords({"x": rng.normal(size=(40_000, 16)).astype(np.float32)})
    cut = 15_000
    for durable in (True, False):
        calls.clear()
        path = tmp_path / f"durable-{durable}.tfrecord"
        writer = TFRecordFileWriter(str(path), durable=durable, direct=False)
        writer.write(framed, 0, 3)  # small: no hint
        writer.write(framed, 3, cut)
        writer.write(framed, cut)
        writer.close()
        assert path.read_bytes() == framed.view().tobytes()
        small, first = framed.num_bytes(0, 3), framed.num_bytes(3, cut)
        assert calls == ([(small, first), (small + first, framed.num_bytes(cut))] if durable else [])
    with open(tmp_path / "durable-True.tfrecord", "rb") as handle:
        assert built.start_writeback(handle.fileno(), 0, 0) is None
        with pytest.raises(ValueError, match="must not be negative"):
            built.start_writeback(handle.fileno(), -1, 10)
