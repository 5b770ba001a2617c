"""The reader of each source format, and `open_reader`, the one place that picks it."""

from __future__ import annotations

from pipeline_lib.config import DataConfig, DataFormat
from pipeline_lib.data.errors import ConversionError, raise_if_outage
from pipeline_lib.data.readers.base import Reader
from pipeline_lib.data.readers.csv import CsvReader
from pipeline_lib.data.readers.jsonl import JsonlReader
from pipeline_lib.data.readers.npz import NpzReader
from pipeline_lib.data.readers.parquet import ParquetReader
from pipeline_lib.data.sources import ListedFile

READERS: dict[DataFormat, type[Reader]] = {
    DataFormat.CSV: CsvReader,
    DataFormat.PARQUET: ParquetReader,
    DataFormat.JSONL: JsonlReader,
    DataFormat.NPZ: NpzReader,
}


def open_reader(fs, source: ListedFile, data: DataConfig) -> Reader:
    """The reader for `source`'s format, opened on `fs`.

    Raises:
        ConversionError: when the file cannot be read as its format.
        StorageUnavailable: when the storage does not answer while the file is opened.
    """
    try:
        return READERS[source.format](fs, source, data)
    except ConversionError:
        raise
    except Exception as error:  # re-raised unless it is an outage or a format problem
        raise_if_outage(error, source.uri, "opening")
        if not isinstance(error, (OSError, ValueError, UnicodeDecodeError)):
            raise
        raise ConversionError(
            f"{source.uri} cannot be read as {source.format.value} ({type(error).__name__}: {error}); "
            "check data.format and the file"
        ) from None
