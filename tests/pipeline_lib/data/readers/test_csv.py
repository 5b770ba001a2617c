"""The CSV reader: blocks of whole lines, parsed on every core, with the rows, values and bad lines of the line-by-line parse."""

from __future__ import annotations

import gzip
import io
import logging
import random

import fsspec
import fsspec.compression
import pytest
from isal import igzip

from pipeline_lib.config import DataConfig
from pipeline_lib.data.convert import convert
from pipeline_lib.data.errors import ConversionError
from pipeline_lib.data.readers import csv as csv_reader


def _messy_csv(path, with_strings: bool = True) -> str:
    """600 rows in blocks of 50 lines: the first clean (the types come from it), the next seven not, the rest clean.

    With strings, a text column `color`; without, every column a number, so that the clean blocks are parsed by
    the C loop (`_native_csv.c`) and the others by Arrow.
    """
    rng = random.Random(7)
    red, header = (",red", ",color") if with_strings else ("", "")
    lines = [f"id,x,n{header},y"] + [f"{i},{rng.uniform(-5, 5):.3f},{rng.randint(-9, 9)}"
                                     + (f",{rng.choice(['red', 'blue'])}" if with_strings else "") + f",{i % 3}"
                                     for i in range(600)]
    lines[75] = f"74, 1.5,3{red},1"  # a space before a number: coercion of the string refuses it
    lines[120] = f"119,abc,3{red},1"  # not a number
    lines[160] = ""  # a blank line
    lines[210] = f"209,,3{red},1"  # a missing cell (imputed)
    lines[260] = "259,1.0,2"  # too few fields
    lines[300] = f'299,"2.25",nan{red},1'  # a quoted number, and 'nan' in an int column
    lines[330] = f"329,inf,4.0{red},1"  # 'inf' is a float; 4.0 is not an int64
    lines[351] = "350,1e3,7,bl\tue,2" if with_strings else "350,1e3,7,2"  # a tab inside a string; 1e3 (plain)
    lines[402] = f"401,-0.000000000001,-0{red},0"  # numbers Arrow reads, not in the C loop's plain forms
    text = "\r\n".join(lines[:100]) + "\r\n" + "\n".join(lines[100:])  # CRLF lines, then LF, no final newline
    path.write_bytes(text.encode())
    return str(path)


def _convert_both_ways(tmp_path, monkeypatch, caplog, with_strings: bool = True, **settings):
    """(manifest, warnings) of the conversion as it runs, and of one that parses every block line by line."""
    source = _messy_csv(tmp_path / "messy.csv", with_strings)
    data = DataConfig(source=source, label="y", read_chunk_rows=50, on_bad_record="skip", **settings)
    results = []
    paths: list[str] = []
    read, parse_lines = csv_reader.CsvReader._read, csv_reader.CsvReader._parse_lines
    parse_plain = csv_reader.CsvReader._parse_plain

    def spy_read(self, text, needed, types, threads, on_invalid=None):
        table = read(self, text, needed, types, threads, on_invalid)
        paths.append("typed" if types else "strings")
        return table

    def spy_parse_lines(self, *args):
        paths.append("lines")
        return parse_lines(self, *args)

    def spy_parse_plain(self, *args):
        columns = parse_plain(self, *args)
        if columns is not None:
            paths.append("plain")
        return columns

    monkeypatch.setattr(csv_reader.CsvReader, "_read", spy_read)
    monkeypatch.setattr(csv_reader.CsvReader, "_parse_lines", spy_parse_lines)
    monkeypatch.setattr(csv_reader.CsvReader, "_parse_plain", spy_parse_plain)
    for name, line_by_line in (("fast", False), ("lines", True)):
        if line_by_line:
            monkeypatch.setattr(csv_reader.CsvReader, "_parse",
                                lambda self, text, num_lines, line_start, needed, num_bytes:
                                self._parse_lines(text, line_start, needed, num_bytes))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="pipeline_lib.data.bad_records"):
            manifest = convert(data, str(tmp_path / name))
        results.append((manifest, [r.getMessage() for r in caplog.records]))
        if not line_by_line:
            # The blocks with a blank line and with too few fields are parsed line by line, the clean ones by the
            # C loop: the one whose only odd values are 1e3 and a tab in a string (both plain) and the last three,
            # and the first too (its types guessed) when every column is a number; -0.000000000001 is not in a
            # plain form (its block goes to Arrow, as do the blocks with bad values).
            assert paths.count("lines") == 2, paths
            if with_strings:
                assert paths[0] == "strings" and paths.count("plain") == 4, paths
            else:
                assert paths[0] == "plain" and paths.count("plain") == 5, paths
    return results


@pytest.mark.parametrize("with_strings", [True, False], ids=["a-text-column", "numbers-only"])
def test_blocks_parsed_on_every_core_write_the_shards_and_name_the_bad_lines_of_the_line_by_line_parse(
        tmp_path, monkeypatch, caplog, with_strings):
    (fast, fast_log), (lines, lines_log) = _convert_both_ways(tmp_path, monkeypatch, caplog, with_strings)
    assert [(s.path, s.num_records, s.digest) for s in fast.shards] == \
        [(s.path, s.num_records, s.digest) for s in lines.shards]
    assert fast.num_bad_records == lines.num_bad_records == 5
    assert fast_log == lines_log
    text = "\n".join(fast_log)
    for where in ("line 76, column 'x': value ' 1.5'", "line 121, column 'x': value 'abc'", "line 261 has 3 field",
                  "line 301, column 'n': value 'nan'", "line 331, column 'n': value '4.0'"):
        assert where in text


def test_a_bad_value_in_a_block_parsed_to_numbers_fails_naming_its_line(tmp_path):
    source = _messy_csv(tmp_path / "messy.csv")
    with pytest.raises(ConversionError, match=r"messy.csv line 76, column 'x': value ' 1.5' cannot be converted"):
        convert(DataConfig(source=source, label="y", read_chunk_rows=50), str(tmp_path / "out"))


@pytest.mark.parametrize("num_lines", [1, 3, 50])
def test_record_blocks_hold_whole_lines_and_count_them(num_lines):
    lines = [f"{i}," + "x" * (i % 17) + ("\r\n" if i % 5 == 0 else "\n") for i in range(103)]
    text = "".join(lines).encode()
    for last_newline in (True, False):
        data = text if last_newline else text[:-1]
        blocks = list(csv_reader.record_blocks(io.BytesIO(data), num_lines))
        assert [n for _, n, _ in blocks] == [num_lines] * (103 // num_lines) + ([103 % num_lines] if 103 % num_lines else [])
        assert b"".join(block for block, _, _ in blocks) == text  # a missing last newline is added
        assert sum(size for _, _, size in blocks) == len(data)
        assert all(block.count(b"\n") == n for block, n, _ in blocks)


def test_a_gzip_csv_inflated_by_isa_l_or_zlib_converts_as_the_plain_file_with_the_same_bad_lines(
        tmp_path, monkeypatch, caplog):
    """ISA-L's inflate (fsspec's "gzip" codec when `isal` is installed, a dependency) and the stdlib's zlib one
    (fsspec's fallback without it) give the plain file's shards and bad lines; two gzip members, as `cat` makes."""
    plain = _messy_csv(tmp_path / "messy.csv")
    text = (tmp_path / "messy.csv").read_bytes()
    packed = tmp_path / "messy.csv.gz"
    packed.write_bytes(gzip.compress(text[:5000], 6) + gzip.compress(text[5000:], 1))
    fs = fsspec.filesystem("file")
    with fs.open(str(packed), "rb", compression="infer") as handle:
        assert isinstance(handle, igzip.IGzipFile)

    def converted(source: str, name: str):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="pipeline_lib.data.bad_records"):
            manifest = convert(DataConfig(source=source, label="y", read_chunk_rows=50, on_bad_record="skip"),
                               str(tmp_path / name))
        return [(s.num_records, s.digest) for s in manifest.shards], [r.getMessage() for r in caplog.records]

    expected_shards, expected_log = converted(plain, "plain")
    assert len(expected_log) == 5
    expected_log = [m.replace("messy.csv", "messy.csv.gz") for m in expected_log]
    assert converted(str(packed), "isal") == (expected_shards, expected_log)
    monkeypatch.setitem(fsspec.compression.compr, "gzip", lambda f, **kwargs: gzip.GzipFile(fileobj=f, **kwargs))
    with fs.open(str(packed), "rb", compression="infer") as handle:
        assert isinstance(handle, gzip.GzipFile)
    assert converted(str(packed), "zlib") == (expected_shards, expected_log)
