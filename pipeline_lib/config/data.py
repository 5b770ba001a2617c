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
    seed: int = 0
    key_columns: tuple[str, ...] | None = None  # None: hash the whole row


class ColumnMissingConfig(_Frozen):
    """`data.missing_columns.<column>`: per-column overrides of the missing-value settings (unset: the data default)."""

    missing: MissingPolicy | None = None
    impute_with: ImputeWith | None = None
    impute_value: float | None = None
    missing_indicator: bool | None = None


class ColumnMissing(_Frozen):  # the settings that apply to one column, overrides resolved
    missing: MissingPolicy
    impute_with: ImputeWith
    impute_value: float
    missing_indicator: bool


class DataConfig(CsvOptions):
    source: str  # fsspec URI or glob
    format: DataFormat = DataFormat.AUTO
    label: str
    features: tuple[str, ...] | None = None  # None: every column but the label
    storage_options: SecretSettings = Field(default_factory=dict)  # secrets: masked in every dump
    split: SplitConfig = SplitConfig()
    target_shard_mb: float = Field(8.0, gt=0.0)
    compression: Compression = Compression.NONE
    # gzip only: zlib's level. Level 1 deflated rounded tabular floats 5-6x faster than zlib's default 6 here, for
    # shards 15-35 % larger; conversion is meant to keep pace with the disk.
    compression_level: int = Field(1, ge=0, le=9)
    on_bad_record: OnBadRecord = OnBadRecord.FAIL
    read_chunk_rows: int = Field(65536, ge=1)
    # ray: one task per source file (Parquet: per run of row groups) on the Ray cluster of train.ray.address or
    # RAY_ADDRESS, each writing its own shards straight to the dataset; the manifest is still written last.
    engine: DataEngine = DataEngine.LOCAL
    # engine ray: what each conversion task asks of a node (CPU, memory in bytes, custom resources).
    ray_resources: dict[str, float] = Field(default_factory=lambda: {"CPU": 1.0})
    missing: MissingPolicy = MissingPolicy.IMPUTE  # features only: a missing label is a bad record
    impute_with: ImputeWith = ImputeWith.MEAN
    impute_value: float = 0.0  # with impute_with: constant
    missing_indicator: bool = False  # impute: add a `<column>_missing` 0/1 input to the model
    missing_columns: dict[str, ColumnMissingConfig] = Field(default_factory=dict)
    # CSV and JSONL columns of ISO 8601 dates or timestamps, read as instants (Parquet's are typed already).
    parse_dates: tuple[str, ...] = ()

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
