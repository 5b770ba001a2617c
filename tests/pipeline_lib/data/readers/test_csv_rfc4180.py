"""CSV as RFC 4180 defines it, at any size: quoted line breaks across block boundaries, the options
(`data.csv_quote_char`, `csv_column_names`, `csv_encoding`) and the errors that name the line."""

from __future__ import annotations

import csv
import io
import random

import numpy as np
import pandas as pd
import pyarrow.csv as pacsv
import pytest
from pydantic import ValidationError

from pipeline_lib.config import DataConfig
from pipeline_lib.core import native
from pipeline_lib.data.convert import convert
from pipeline_lib.data.errors import ConversionError
from pipeline_lib.data.readers import csv_records
from tests.pipeline_lib.data.conversion_support import read_all

NOTES = ["plain", "two\nlines", "crlf\r\ninside", 'say "hi", then\nleave', "", "ünïcödé, ☃", "a,b,c", '"', "\n\n"]


def _frame(num_rows: int, seed: int = 0) -> pd.DataFrame:
    rng = random.Random(seed)
    return pd.DataFrame({
        "id": np.arange(num_rows),
        "x": [round(rng.uniform(-5, 5), 3) for _ in range(num_rows)],
        "note": [rng.choice(NOTES) + str(i % 7) for i in range(num_rows)],
        "y": [rng.randint(0, 2) for _ in range(num_rows)],
    })


def _rows_by_id(manifest) -> dict[int, tuple]:
    records = read_all(manifest)
    return {int(i): (float(x), note.decode(), int(y))
            for i, x, note, y in zip(records["id"], records["x"], records["note"], records["y"])}


def _expected(frame: pd.DataFrame) -> dict[int, tuple]:
    return {int(r.id): (float(np.float32(r.x)), r.note, int(r.y)) for r in frame.itertuples()}


@pytest.mark.parametrize("lineterminator", ["\n", "\r\n"])
def test_a_pandas_csv_with_line_breaks_in_quoted_text_converts_every_row_at_every_block_size(tmp_path, lineterminator):
    """The reported case, small: pandas quotes text holding line breaks; blocks of 1, 2, 7 and 64 records cut
    between records, never inside a quote, and every row arrives whole, in every split the hash gives it."""
    frame = _frame(300)
    path = tmp_path / "notes.csv"
    frame.to_csv(path, index=False, lineterminator=lineterminator)
    reference = pacsv.read_csv(path, parse_options=pacsv.ParseOptions(newlines_in_values=True))
    assert reference.num_rows == 300
    digests = set()
    for chunk_rows in (1, 2, 7, 64, 65536):
        manifest = convert(DataConfig(source=str(path), label="y", read_chunk_rows=chunk_rows),
                           str(tmp_path / f"out{chunk_rows}"))
        assert manifest.num_bad_records == 0
        assert _rows_by_id(manifest) == _expected(frame)
        digests.add(tuple(s.digest for s in manifest.shards))
    assert len(digests) == 1  # the block size changes nothing written


def test_without_the_c_loop_the_records_are_found_by_the_same_rules(tmp_path, monkeypatch):
    frame = _frame(120, seed=3)
    path = tmp_path / "notes.csv"
    frame.to_csv(path, index=False)
    with_c = convert(DataConfig(source=str(path), label="y", read_chunk_rows=5), str(tmp_path / "c"))
    monkeypatch.setattr(native, "module", None)
    without = convert(DataConfig(source=str(path), label="y", read_chunk_rows=5), str(tmp_path / "py"))
    assert [s.digest for s in with_c.shards] == [s.digest for s in without.shards]


def test_a_bad_row_after_multi_line_records_is_named_by_the_line_it_starts_on(tmp_path):
    lines = ["id,note,y"]
    for i in range(40):  # each record takes three lines
        lines.append(f'{i},"first\nsecond\nthird",{i % 2}')
    text = "\n".join(lines) + "\n"
    bad_line = text.count("\n") + 1
    text += "40,too,many,fields\n" + '41,"x\ny",1\n'  # 41's value spans two lines
    (tmp_path / "bad.csv").write_text(text)
    source = str(tmp_path / "bad.csv")
    for chunk_rows in (3, 100):
        with pytest.raises(ConversionError, match=rf"bad.csv line {bad_line} has 4 field\(s\) but the header has 3"):
            convert(DataConfig(source=source, label="y", read_chunk_rows=chunk_rows), str(tmp_path / "fail"))
        manifest = convert(DataConfig(source=source, label="y", read_chunk_rows=chunk_rows, on_bad_record="skip"),
                           str(tmp_path / f"skip{chunk_rows}"))
        assert manifest.num_bad_records == 1
        ids = sorted(read_all(manifest)["id"].tolist())
        assert ids == [*range(40), 41]


def test_a_bad_value_after_multi_line_records_is_named_by_its_line(tmp_path):
    text = "id,note,y\n" + "".join(f'{i},"a\nb",{i % 2}\n' for i in range(10)) + "10,plain,x\n"
    (tmp_path / "bad.csv").write_text(text)
    with pytest.raises(ConversionError, match=r"bad.csv line 22, column 'y': value 'x'"):
        convert(DataConfig(source=str(tmp_path / "bad.csv"), label="y", read_chunk_rows=4), str(tmp_path / "o"))


def test_an_unclosed_quote_is_an_error_naming_the_lines_and_the_fix(tmp_path):
    text = "id,note,y\n" + "".join(f'{i},"a\nb",{i % 2}\n' for i in range(10)) + '10,"never closed,1\n11,b,0\n'
    (tmp_path / "open.csv").write_text(text)
    for chunk_rows in (3, 1000):
        with pytest.raises(ConversionError, match=r"open.csv line 22: a field opened with data.csv_quote_char "
                                                  r"\('\"'\) is never closed; close it"):
            convert(DataConfig(source=str(tmp_path / "open.csv"), label="y", read_chunk_rows=chunk_rows),
                    str(tmp_path / "o"))


def test_the_quote_character_no_header_and_a_bom_are_options_of_the_source(tmp_path):
    frame = _frame(50, seed=1)
    text = frame.to_csv(index=False, header=False, quotechar="'", quoting=csv.QUOTE_NONNUMERIC)
    (tmp_path / "q.csv").write_bytes(b"\xef\xbb\xbf" + text.encode())
    manifest = convert(DataConfig(source=str(tmp_path / "q.csv"), label="y", read_chunk_rows=3, csv_quote_char="'",
                                  csv_column_names=("id", "x", "note", "y")), str(tmp_path / "o"))
    assert _rows_by_id(manifest) == _expected(frame)


def test_without_quoting_a_quote_is_an_ordinary_character(tmp_path):
    (tmp_path / "raw.csv").write_text('id,inch,y\n1,5",0\n2,"7,1\n')
    manifest = convert(DataConfig(source=str(tmp_path / "raw.csv"), label="y", csv_quote_char=None),
                       str(tmp_path / "o"))
    records = read_all(manifest)
    assert sorted(records["inch"].tolist()) == [b'"7', b'5"']


@pytest.mark.parametrize("encoding", ["latin-1", "cp1252"])
def test_latin_1_and_cp1252_text_is_decoded(tmp_path, encoding):
    frame = pd.DataFrame({"id": range(30), "city": ["Zürich", "Besançon", "€uro" if encoding == "cp1252" else "ß",
                                                      "plain"] * 7 + ["x"] * 2, "y": [0, 1] * 15})
    frame.to_csv(tmp_path / "t.csv", index=False, encoding=encoding)
    manifest = convert(DataConfig(source=str(tmp_path / "t.csv"), label="y", csv_encoding=encoding,
                                  read_chunk_rows=4), str(tmp_path / "o"))
    records = read_all(manifest)
    got = dict(zip(records["id"].tolist(), (c.decode() for c in records["city"])))
    assert got == dict(zip(frame["id"], frame["city"]))


def test_bytes_the_encoding_cannot_decode_are_named_by_file_line_and_encoding(tmp_path):
    text = "id,city,y\n" + "".join(f"{i},plain,{i % 2}\n" for i in range(20))
    (tmp_path / "utf.csv").write_bytes(text.encode() + b"20,Z\xfcrich,1\n")  # Latin-1's ü in a UTF-8 file
    with pytest.raises(ConversionError, match=r"utf.csv line 22: byte 'fc' cannot be decoded as utf-8 "
                                              r"\(data.csv_encoding\); set data.csv_encoding"):
        convert(DataConfig(source=str(tmp_path / "utf.csv"), label="y", read_chunk_rows=8), str(tmp_path / "o"))
    (tmp_path / "win.csv").write_bytes(text.encode() + b"20,\x81,1\n")  # undefined in cp1252
    with pytest.raises(ConversionError, match=r"win.csv line 22: byte '81' cannot be decoded as cp1252"):
        convert(DataConfig(source=str(tmp_path / "win.csv"), label="y", csv_encoding="cp1252"), str(tmp_path / "o"))


@pytest.mark.parametrize("settings, message", [
    ({"csv_encoding": "utf-16"}, "'utf-16' is not a supported CSV encoding; use utf-8, latin-1 or cp1252"),
    ({"csv_encoding": "klingon"}, "'klingon' is not a supported CSV encoding"),
    ({"csv_quote_char": ","}, "csv_quote_char and csv_delimiter are both ','"),
    ({"csv_delimiter": ";;"}, "';;' is not one character"),
    ({"csv_column_names": ["a", "a"]}, "repeats \\['a'\\]"),
])
def test_csv_options_are_checked_when_the_config_is_read(settings, message):
    with pytest.raises(ValidationError, match=message):
        DataConfig(source="x.csv", label="y", **settings)


def test_encoding_names_are_normalized():
    assert DataConfig(source="x.csv", label="y", csv_encoding="ISO-8859-1").csv_encoding == "latin-1"
    assert DataConfig(source="x.csv", label="y", csv_encoding="UTF8").csv_encoding == "utf-8"


def test_record_blocks_never_end_inside_a_quote_whatever_the_reads(tmp_path):
    """Reads of a few bytes at a time, so that every scan resumes mid-field, mid-quote and between two quotes."""

    class Trickle(io.BytesIO):
        def readinto(self, buffer):
            with memoryview(buffer) as view:
                return super().readinto(view[:3])

    text = _frame(60, seed=2).to_csv(index=False).encode()
    expected = pacsv.read_csv(io.BytesIO(text), parse_options=pacsv.ParseOptions(newlines_in_values=True))
    for chunk_rows in (1, 4, 9):
        blocks = list(csv_records.record_blocks(Trickle(text), chunk_rows))
        assert b"".join(block for block, _, _ in blocks) == text
        assert sum(n for _, n, _ in blocks) == expected.num_rows + 1  # the header is a record here
        for block, n, _ in blocks:
            assert pacsv.read_csv(io.BytesIO(block), read_options=pacsv.ReadOptions(autogenerate_column_names=True),
                                  parse_options=pacsv.ParseOptions(newlines_in_values=True)).num_rows == n


def test_the_reported_table_at_scale_converts_every_row_with_the_default_block_size(tmp_path):
    """The case that was refused: more rows than one default block (65,536 records), quoted text with line breaks
    throughout; with on_bad_record: skip nothing is dropped either."""
    frame = _frame(90_000, seed=5)
    path = tmp_path / "notes.csv"
    frame.to_csv(path, index=False)
    assert path.read_bytes().count(b"\n") > 100_000  # more lines than records: the old cut fell inside quotes
    manifest = convert(DataConfig(source=str(path), label="y", on_bad_record="skip"), str(tmp_path / "out"))
    assert manifest.num_bad_records == 0
    assert manifest.num_records("train") + manifest.num_records("eval") == 90_000
    assert _rows_by_id(manifest) == _expected(frame)
