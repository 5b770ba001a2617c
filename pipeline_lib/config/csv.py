"""The options of a CSV source, named as `pyarrow.csv` names them: shared by `data` (conversion) and `predict`
(batch scoring), so that a table that converts can be scored with the same settings."""

from __future__ import annotations

import codecs

from pydantic import Field, field_validator, model_validator

from pipeline_lib.config.base import _Frozen

# Encodings whose line end is the ASCII byte b"\n" and which never put that byte inside a character: blocks of
# lines are cut on bytes, then decoded. By `codecs.lookup(...).name`.
CSV_ENCODINGS = {"utf-8": "utf-8", "iso8859-1": "latin-1", "cp1252": "cp1252"}


class CsvOptions(_Frozen):
    """`csv_delimiter`, `csv_quote_char`, `csv_column_names` and `csv_encoding` of a CSV source (RFC 4180)."""

    csv_delimiter: str = Field(",", description="The byte between fields (pyarrow.csv's delimiter)")
    csv_quote_char: str | None = Field(
        '"', description="The character that quotes a field holding the delimiter, a quote (doubled) or a line "
                         "break (pyarrow.csv's quote_char); null: fields are never quoted")
    csv_column_names: tuple[str, ...] | None = Field(
        None, description="The column names of a CSV without a header row (pyarrow.csv's column_names): its "
                          "first line is data. Unset: the first line is the header")
    csv_encoding: str = Field("utf-8", description="The text's encoding: utf-8 (a byte-order mark is skipped), "
                                                   "latin-1 or cp1252 (pyarrow.csv's encoding)")

    @field_validator("csv_delimiter")
    @classmethod
    def _one_delimiter(cls, value: str) -> str:
        if len(value) != 1 or value in "\r\n":
            raise ValueError(f"{value!r} is not one character other than a line break; give one, e.g. ',' or "
                             "'\\t' or ';'")
        return value

    @field_validator("csv_quote_char")
    @classmethod
    def _one_quote(cls, value: str | None) -> str | None:
        if value is not None and (len(value) != 1 or value in "\r\n"):
            raise ValueError(f"{value!r} is not one character other than a line break; give one, e.g. '\"' or "
                             "\"'\", or null for a CSV without quoting")
        return value

    @field_validator("csv_encoding")
    @classmethod
    def _ascii_newline(cls, value: str) -> str:
        try:
            name = codecs.lookup(value).name
        except LookupError:
            name = None
        if name not in CSV_ENCODINGS:
            raise ValueError(f"{value!r} is not a supported CSV encoding; use utf-8, latin-1 or cp1252 (encodings "
                             "whose line break is the ASCII newline byte), or convert the file to UTF-8 first")
        return CSV_ENCODINGS[name]

    @field_validator("csv_column_names")
    @classmethod
    def _unique_names(cls, names: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if names is not None:
            if not names:
                raise ValueError("is empty; list the columns of a CSV without a header row, or leave it unset")
            repeated = sorted({n for n in names if names.count(n) > 1})
            if repeated:
                raise ValueError(f"repeats {repeated}; name each column once")
        return names

    @model_validator(mode="after")
    def _distinct_delimiter(self) -> CsvOptions:
        if self.csv_quote_char is not None and self.csv_quote_char == self.csv_delimiter:
            raise ValueError(f"csv_quote_char and csv_delimiter are both {self.csv_delimiter!r}; make them differ")
        return self
