"""`data`: the source, its conversion and split, and what a missing value does."""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from pipeline_lib.config.base import (
    Compression,
    DataEngine,
    DataFormat,
    ImputeWith,
    MissingPolicy,
    OnBadRecord,
    SecretSettings,
    _Frozen,
)
from pipeline_lib.config.csv import CsvOptions
from pipeline_lib.config.ray import checked_resources


class SplitConfig(_Frozen):
    """Deterministic hash split of rows into train and eval."""

    eval_fraction: float = Field(0.2, gt=0.0, lt=1.0)
    """The share of rows in the eval split: a row lands in the same split on every run"""
    seed: int = 0
    """The split hash's seed: another seed, another split"""
    key_columns: tuple[str, ...] | None = None  # None: hash the whole row
    """The columns hashed to split rows (rows with the same keys stay together); unset: the whole row"""


class ColumnMissingConfig(_Frozen):
    """`data.missing_columns.<column>`: per-column overrides of the missing-value settings (unset: the data default)."""

    missing: MissingPolicy | None = None
    """impute, skip or fail for this column (unset: data.missing)"""
    impute_with: ImputeWith | None = None
    """mean, median or constant for this column (unset: data.impute_with)"""
    impute_value: float | None = None
    """The constant fill value of this column (unset: data.impute_value)"""
    missing_indicator: bool | None = None
    """Whether this column also gets a 0/1 <column>_missing input (unset: data.missing_indicator)"""


class ColumnMissing(_Frozen):  # the settings that apply to one column, overrides resolved
    missing: MissingPolicy
    impute_with: ImputeWith
    impute_value: float
    missing_indicator: bool


class DataConfig(CsvOptions):
    source: str  # fsspec URI or glob
    """fsspec URI or glob of the raw table(s)"""
    format: DataFormat = DataFormat.AUTO
    """`csv`, `parquet`, `jsonl`, `npz`, or `auto` (by extension)"""
    label: str
    """label column; its train split must hold two values or more (one value is refused before training, exit 2,
    naming it)"""
    features: tuple[str, ...] | None = None  # None: every column but the label
    """feature columns"""
    storage_options: SecretSettings = Field(default_factory=dict)  # secrets: masked in every dump
    """fsspec options for the source"""
    split: SplitConfig = SplitConfig()
    """The deterministic hash split of rows into train and eval"""
    target_shard_mb: float = Field(8.0, gt=0.0)
    """target TFRecord shard size"""
    compression: Compression = Compression.NONE
    """`none` or `gzip` (shards deflated in 1 MiB blocks on every core)"""
    # gzip only: zlib's level. Level 1 deflated rounded tabular floats 5-6x faster than zlib's default 6 here, for
    # shards 15-35 % larger; conversion is meant to keep pace with the disk.
    compression_level: int = Field(1, ge=0, le=9)
    """0–9 on zlib's scale for `gzip`: 1, the fastest, is deflated by ISA-L (about ten times zlib's level 1 on
    records, no bigger), every other level by zlib"""
    on_bad_record: OnBadRecord = OnBadRecord.FAIL
    """`fail` (error names file, line, column, value) or `skip` (counted, reported)"""
    read_chunk_rows: int = Field(65536, ge=1)
    """rows read per chunk: memory stays bounded for inputs larger than RAM (Parquet row groups of up to 128 MiB
    in the columns read are decoded whole, the next one ahead, then cut into chunks; larger ones are read
    chunk by chunk)"""
    # ray: one task per source file (Parquet: per run of row groups) on the Ray cluster of train.ray.address or
    # RAY_ADDRESS, each writing its own shards straight to the dataset; the manifest is still written last.
    engine: DataEngine = DataEngine.LOCAL
    """ray: one task per source file (Parquet: per run of row groups) on the Ray cluster of train.ray.address or
    RAY_ADDRESS, each writing its own shards straight to the dataset; the manifest is still written last."""
    # engine ray: what each conversion task asks of a node (CPU, memory in bytes, custom resources).
    ray_resources: dict[str, float] = Field(default_factory=lambda: {"CPU": 1.0})
    """engine ray: what each conversion task asks of a node (CPU, memory in bytes, custom resources)."""
    missing: MissingPolicy = MissingPolicy.IMPUTE  # features only: a missing label is a bad record
    """a missing feature value (an empty CSV cell, a null, an empty string, a NaN already in a float column of a
    Parquet, NPZ or JSONL source, or spelled `nan`, `NaN` or `NAN` in a float column of a CSV; `NA` and `null`
    are not missing: in the first chunk they make a CSV column text, after it they are bad values of a numeric
    one): `impute` (numbers filled inside the model, strings out-of-vocabulary), `skip` (the row is dropped
    and counted as a bad record) or `fail` (the error names file, line and column). A missing label is never
    imputed: it is a bad record (`data.on_bad_record`)"""
    impute_with: ImputeWith = ImputeWith.MEAN
    """the fill value of a missing number, from the train split's statistics: `mean`, `median` (the lower median,
    from the sketch, within about 3 %) or `constant` (`impute_value`)"""
    impute_value: float = 0.0  # with impute_with: constant
    """the fill value of a missing number, from the train split's statistics: `mean`, `median` (the lower median,
    from the sketch, within about 3 %) or `constant` (`impute_value`)"""
    missing_indicator: bool = False  # impute: add a `<column>_missing` 0/1 input to the model
    """`impute` also gives the model a 0/1 `<column>_missing` input (not for `cnn`)"""
    missing_columns: dict[str, ColumnMissingConfig] = Field(default_factory=dict)
    """Per-column overrides of missing, impute_with, impute_value and missing_indicator, by column name"""
    # CSV and JSONL columns of ISO 8601 dates or timestamps, read as instants (Parquet's are typed already).
    parse_dates: tuple[str, ...] = ()
    """CSV and JSON Lines columns of ISO 8601 strings read as dates (every value of the first chunk `YYYY-MM-DD`)
    or timestamps (naive: UTC; an offset or `Z` is converted to UTC); a value that does not parse is a bad
    record, an empty cell missing. Each name must be a feature column; a Parquet column typed as a date or
    timestamp is one already (see "Which columns become features")"""

    @field_validator("ray_resources")
    @classmethod
    def _known_resources(cls, value: dict[str, float]) -> dict[str, float]:
        return checked_resources("ray_resources", value)

    def missing_for(self, column: str) -> ColumnMissing:
        """The missing-value settings of `column`: its `missing_columns` entry over the data defaults."""
        override = self.missing_columns.get(column, ColumnMissingConfig())
        return ColumnMissing(
            missing=override.missing or self.missing,
            impute_with=override.impute_with or self.impute_with,
            impute_value=self.impute_value if override.impute_value is None else override.impute_value,
            missing_indicator=(self.missing_indicator if override.missing_indicator is None
                               else override.missing_indicator),
        )

    @model_validator(mode="after")
    def _missing_label(self) -> DataConfig:
        if self.label in self.missing_columns:
            raise ValueError(f"missing_columns names the label {self.label!r}; a missing label is never imputed "
                             "but a bad record (data.on_bad_record decides); remove it from missing_columns")
        return self

    @field_validator("source")
    @classmethod
    def _source_not_empty(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must be a non-empty fsspec URI or glob, e.g. ./data/*.csv or s3://bucket/raw/*.parquet")
        return value
