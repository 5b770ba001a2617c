"""The table a batch-scoring run reads chunk by chunk, and the output it writes whole or not at all."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from pipeline_lib.config import DataConfig, DataFormat, OutputFormat, PredictConfig
from pipeline_lib.config.csv import CsvOptions
from pipeline_lib.core import storage
from pipeline_lib.data.readers.base import MISSING, RawChunk
from pipeline_lib.data.readers.registry import open_reader
from pipeline_lib.data.sources import ListedFile, list_source
from pipeline_lib.prediction.models import PredictionError

# The Parquet schema's key-value metadata key, and the CSV output's sidecar suffix, that hold the run's record.
METADATA_KEY = "tfdag.predict"
CSV_METADATA_SUFFIX = ".meta.json"
# The marker a directory of parts (engine ray) gets last: the run's record and its parts; no marker, no output.
PARTS_MARKER = "_tfdag_predict.json"
_OUTPUT_EXTENSIONS = {".parquet": OutputFormat.PARQUET, ".pq": OutputFormat.PARQUET, ".csv": OutputFormat.CSV}


@dataclass
class Chunk:
    """Rows of one input file: the model's columns as a DataFrame, the kept columns as Arrow arrays."""

    raw: RawChunk
    frame: pd.DataFrame
    kept: dict[str, pa.Array]


def output_format(config: PredictConfig) -> OutputFormat:
    """`output_format`, else OUTPUT's extension."""
    if config.output_format is not None:
        return config.output_format
    extension = os.path.splitext(config.output.rstrip("/"))[1].lower()
    if extension not in _OUTPUT_EXTENSIONS:
        raise PredictionError(f"output {config.output!r} has no .parquet or .csv extension; name one, or pass "
                              "--format parquet|csv (output_format)")
    return _OUTPUT_EXTENSIONS[extension]


def read_chunks(config: PredictConfig, columns: Sequence[Mapping[str, Any]], label: str) -> Iterator[Chunk]:
    """Every row of INPUT's files, in file order, `config.batch_rows` at a time.

    Args:
        config: the input, its format and options, the kept columns and the chunk size.
        columns: the model's columns (`tfdag_scoring.Scorer.columns`).
        label: the model's label (a column the input need not have).

    Raises:
        PredictionError: a file lacks a column the model takes or a kept column.
        ConversionError: INPUT names no readable file.
    """
    data = input_data(config, label)
    fs, files = list_source(data)
    for source in files:
        yield from file_chunks(config, data, fs, source, columns)


def input_data(config: PredictConfig, label: str) -> DataConfig:
    """INPUT as a conversion's data section: how its files are listed and read."""
    return DataConfig(source=config.input, format=config.input_format, label=label,
                      storage_options=dict(config.storage_options), read_chunk_rows=config.batch_rows,
                      **{name: getattr(config, name) for name in CsvOptions.model_fields})


def file_chunks(config: PredictConfig, data: DataConfig, fs, source: ListedFile, columns: Sequence[Mapping[str, Any]],
                row_groups: range | None = None) -> Iterator[Chunk]:
    """The rows of one INPUT file (of these Parquet row groups only, when given), `config.batch_rows` at a time."""
    names = [c["name"] for c in columns]
    numbers = {c["name"] for c in columns if c["dtype"] != "string"}
    needed = list(dict.fromkeys([*names, *config.keep]))
    reader = open_reader(fs, source, data)
    available = reader.available_columns()
    absent = [n for n in names if n not in available]
    if absent:
        raise PredictionError(f"{source.uri} has no column {', '.join(map(repr, absent))}; the model takes "
                              f"{names} (other columns are ignored)")
    absent = [n for n in config.keep if n not in available]
    if absent:
        raise PredictionError(f"{source.uri} has no column {', '.join(map(repr, absent))} to keep (--keep); "
                              f"its columns are {available}")
    if row_groups is not None:
        reader.select_row_groups(row_groups)
    is_csv = source.format == DataFormat.CSV
    for raw in reader.chunks(needed, config.batch_rows):
        frame = pd.DataFrame({n: _series(raw.columns[n], is_csv and n in numbers) for n in names})
        yield Chunk(raw=raw, frame=frame, kept={n: _arrow(raw.columns[n]) for n in config.keep})


def _series(values: Any, empty_is_missing: bool) -> pd.Series:
    if isinstance(values, list):  # JSON Lines: Python values, MISSING for an absent key
        return pd.Series([None if v is MISSING else v for v in values], dtype=object)
    if isinstance(values, np.ndarray):
        return pd.Series(list(values) if values.ndim > 1 else values)
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    if empty_is_missing:  # CSV reads every cell as text: an empty one is a missing number, as in conversion
        values = pc.if_else(pc.equal(values, ""), pa.scalar(None, values.type), values)
    return values.to_pandas()


def _arrow(values: Any) -> pa.Array:
    if isinstance(values, list):
        return pa.array([None if v is MISSING else v for v in values])
    if isinstance(values, np.ndarray):
        return pa.array(list(values) if values.ndim > 1 else values)
    return values.combine_chunks() if isinstance(values, pa.ChunkedArray) else values


class OutputWriter:
    """Writes the predictions to a local temporary file and moves it to OUTPUT only in `commit`: a run that fails
    leaves nothing at OUTPUT (an object store gets one upload, which is atomic).

    Parquet keeps the run's record (model, rows, skipped rows) in the file's key-value metadata under
    `tfdag.predict`;
    CSV in a sidecar `<OUTPUT>.meta.json`, written just before the CSV is moved into place.
    """

    def __init__(self, uri: str, fmt: OutputFormat, storage_options: Mapping[str, Any] | None) -> None:
        self.uri, self.format = uri, fmt
        self.fs, self.path = storage.get_fs(uri, dict(storage_options or {}))
        self.is_local = storage.is_local(uri)
        directory = os.path.dirname(storage.local_path(uri)) if self.is_local else None
        if directory:
            os.makedirs(directory, exist_ok=True)
        # Beside OUTPUT when it is local (the rename is atomic), else in the temporary directory until the upload.
        self.tmp = os.path.join(directory or tempfile.gettempdir(),
                                f".{os.path.basename(self.path)}.{uuid.uuid4().hex[:12]}.tmp")
        self.schema: pa.Schema | None = None
        self._writer: Any = None

    def write(self, table: pa.Table) -> None:
        if self._writer is None:
            self.schema = table.schema
            if self.format == OutputFormat.PARQUET:
                self._writer = pq.ParquetWriter(self.tmp, table.schema)
            else:
                self._writer = pacsv.CSVWriter(self.tmp, table.schema)
        elif table.schema != self.schema:
            try:
                table = table.cast(self.schema)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as error:
                raise PredictionError(f"the columns of a later chunk do not match the first chunk's types "
                                      f"{self.schema} ({error}); give every file of the input the same column "
                                      "types") from None
        self._writer.write_table(table)

    def commit(self, record: Mapping[str, Any] | None) -> None:
        """Close the file with `record` as its metadata (None: a part of a directory, whose marker holds the record)
        and move it to OUTPUT."""
        text = json.dumps(record, sort_keys=True, default=str)
        if self.format == OutputFormat.PARQUET and record is not None:
            self._writer.add_key_value_metadata({METADATA_KEY: text})
        self._writer.close()
        self._writer = None
        if self.format == OutputFormat.CSV and record is not None:
            storage.write_bytes_atomic(self.fs, self.path + CSV_METADATA_SUFFIX, (text + "\n").encode())
        if self.is_local:
            os.replace(self.tmp, self.path)
            storage.fsync_dir(os.path.dirname(self.path) or ".")
        else:
            parent = os.path.dirname(self.path)
            if parent:
                self.fs.makedirs(parent, exist_ok=True)
            self.fs.put_file(self.tmp, self.path)
            os.remove(self.tmp)

    def abort(self) -> None:
        if self._writer is not None:
            with contextlib.suppress(Exception):
                self._writer.close()
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.tmp)


def read_metadata(uri: str, storage_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The record a batch-scoring run left with its output (Parquet metadata, the CSV's sidecar, or the marker of a
    directory of parts)."""
    fs, path = storage.get_fs(uri, dict(storage_options or {}))
    if fs.isdir(path):
        return json.loads(fs.cat_file(storage.join(path, PARTS_MARKER)))
    if path.lower().endswith(".csv"):
        return json.loads(fs.cat_file(path + CSV_METADATA_SUFFIX))
    with fs.open(path, "rb") as handle:
        metadata = pq.read_metadata(handle).metadata or {}
    return json.loads(metadata[METADATA_KEY.encode()])
