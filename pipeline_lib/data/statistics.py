"""Dataset statistics from the conversion pass: per split and column, mergeable exactly across chunks and shards.

Numbers get count, missing, min, max, mean and variance (merged with Chan's parallel update, so chunks, shards or
files combine in any order) and a log-linear sketch: a float32's sign, exponent and top 5 mantissa bits name its
bucket, so buckets are about 3 % wide relative to their value, the same for every dataset, and two sketches merge
by adding counts. Quantiles (the median, drift bins, histograms) come from the sketch. Strings get the count of
each value (exact up to MAX_TRACKED_VALUES distinct values per column, the most frequent kept beyond), so the
number of distinct values, the top values and a vocabulary follow.

A missing number is NaN (float32) or MISSING_INT64 (int64) in the converted values, a missing string is empty:
conversion writes them so when it imputes, and the statistics count them as missing, not as values.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict

from pipeline_lib.core import storage
from pipeline_lib.data.manifest import DType, Manifest

STATISTICS_NAME = "statistics.json"
MISSING_INT64 = -(1 << 63)  # a missing int64 value in the records; the input pipeline reads it as NaN
MAX_TRACKED_VALUES = 10_000
TOP_VALUES = 10  # shown in reports
SKETCH_SHIFT = 18  # float32 bits >> 18 keeps sign, exponent and 5 mantissa bits
NUM_SKETCH_KEYS = 1 << (31 - SKETCH_SHIFT)


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class NumericStatistics(_Frozen):
    """One numeric column of one split. `variance` is the population variance (numpy's default, ddof=0)."""

    count: int  # values present (vectors: every element)
    missing: int
    min: float | None = None
    max: float | None = None
    mean: float | None = None
    variance: float | None = None
    sketch: dict[int, int] = {}  # bucket key → count (see `bucket_value`)

    def quantile(self, q: float) -> float | None:
        """The q-quantile (0..1) from the sketch, within a bucket's width (about 3 %); None without values."""
        if not self.count:
            return None
        keys = sorted(self.sketch, key=bucket_value)
        target = q * self.count
        seen = 0
        for key in keys:
            seen += self.sketch[key]
            if seen >= target:
                return float(min(max(bucket_value(key), self.min), self.max))
        return self.max


class StringStatistics(_Frozen):
    """One string column of one split: the count of every value (the most frequent ones when `truncated`)."""

    count: int
    missing: int  # empty or null values
    values: dict[str, int] = {}
    truncated: bool = False  # more than MAX_TRACKED_VALUES distinct values: `values` holds the most frequent

    @property
    def distinct(self) -> int:
        """Distinct values present (a lower bound when truncated)."""
        return len(self.values)

    def top(self, k: int = TOP_VALUES) -> list[tuple[str, int]]:
        """The k most frequent values, ties in value order."""
        return sorted(self.values.items(), key=lambda item: (-item[1], item[0]))[:k]


class FeatureStatistics(_Frozen):
    """A column of a split: numeric or string statistics, by its dtype."""

    dtype: DType
    numeric: NumericStatistics | None = None
    string: StringStatistics | None = None

    @property
    def count(self) -> int:
        return (self.numeric or self.string).count

    @property
    def missing(self) -> int:
        return (self.numeric or self.string).missing

    @property
    def missing_rate(self) -> float:
        total = self.count + self.missing
        return self.missing / total if total else 0.0


class SplitStatistics(_Frozen):
    num_rows: int
    features: dict[str, FeatureStatistics]  # every feature and the label


class Imputation(_Frozen):
    """How the model fills a numeric feature's missing values: from the train split's statistics."""

    fill_value: float
    indicator: bool = False  # the model also gets `<column>_missing` (0 or 1)


class DatasetStatistics(_Frozen):
    """What `statistics.json` holds: per split ("train", "eval") and column, and the imputation of each feature."""

    label: str
    splits: dict[str, SplitStatistics]
    imputation: dict[str, Imputation] = {}  # numeric features whose missing values are imputed

    def feature(self, name: str, split: str = "train") -> FeatureStatistics | None:
        stats = self.splits.get(split)
        return stats.features.get(name) if stats else None

    def to_json(self) -> str:
        return self.model_dump_json(indent=2)


def _magnitude_start(magnitude: int) -> float:
    """The float32 whose top bits are `magnitude` and whose other bits are zero: a bucket's end nearest zero."""
    return float(np.array([magnitude << SKETCH_SHIFT], dtype=np.uint32).view(np.float32)[0])


def bucket_start(key: int) -> float:
    """A sketch bucket's end nearest zero: exactly the value of every number with few mantissa bits (small
    integers, halves, quarters) that fell in it."""
    start = _magnitude_start(key if key >= 0 else -key - 1)
    return start if key >= 0 else -start


def bucket_value(key: int) -> float:
    """The middle of a sketch bucket."""
    magnitude = key if key >= 0 else -key - 1
    low, high = _magnitude_start(magnitude), _magnitude_start(magnitude + 1)
    middle = (low + high) / 2 if math.isfinite(high) else low
    return middle if key >= 0 else -middle


def most_frequent(values: dict[str, int]) -> tuple[dict[str, int], bool]:
    """`values` cut to the MAX_TRACKED_VALUES most frequent ones, and whether anything was cut."""
    if len(values) <= MAX_TRACKED_VALUES:
        return values, False
    return dict(sorted(values.items(), key=lambda item: (-item[1], item[0]))[:MAX_TRACKED_VALUES]), True


def merge_statistics(parts: Sequence[DatasetStatistics]) -> DatasetStatistics:
    """The statistics of the rows of every part together (each part: disjoint rows, same columns and splits).

    Counts, extremes, sketches and string counts add up exactly; the mean and variance combine pairwise (Chan et
    al.), equal to one pass over every row up to the order of the float64 additions. A string column keeps the
    MAX_TRACKED_VALUES most frequent values of the sum, and is truncated when a part was or the sum is cut.
    """
    first = parts[0]
    splits = {}
    for split, stats in first.splits.items():
        features = {}
        for name, feature in stats.features.items():
            each = [part.splits[split].features[name] for part in parts]
            if feature.numeric is not None:
                features[name] = FeatureStatistics(dtype=feature.dtype,
                                                   numeric=_merge_numeric([f.numeric for f in each]))
            else:
                features[name] = FeatureStatistics(dtype=feature.dtype, string=_merge_string([f.string for f in each]))
        splits[split] = SplitStatistics(num_rows=sum(part.splits[split].num_rows for part in parts),
                                        features=features)
    return DatasetStatistics(label=first.label, splits=splits, imputation=first.imputation)


def _merge_numeric(parts: Sequence[NumericStatistics]) -> NumericStatistics:
    count = mean = m2 = 0.0
    sketch: dict[int, int] = {}
    for part in parts:
        for key, number in part.sketch.items():
            sketch[key] = sketch.get(key, 0) + number
        if not part.count:
            continue
        total = count + part.count
        delta = part.mean - mean
        m2 += part.variance * part.count + delta * delta * count * part.count / total
        mean += delta * part.count / total
        count = total
    missing = sum(part.missing for part in parts)
    present = [part for part in parts if part.count]
    if not present:
        return NumericStatistics(count=0, missing=missing)
    return NumericStatistics(count=int(count), missing=missing, min=min(p.min for p in present),
                             max=max(p.max for p in present), mean=mean, variance=m2 / count,
                             sketch=dict(sorted(sketch.items())))


def _merge_string(parts: Sequence[StringStatistics]) -> StringStatistics:
    values: dict[str, int] = {}
    for part in parts:
        for value, number in part.values.items():
            values[value] = values.get(value, 0) + number
    kept, cut = most_frequent(values)
    return StringStatistics(count=sum(p.count for p in parts), missing=sum(p.missing for p in parts),
                            values=dict(sorted(kept.items())), truncated=cut or any(p.truncated for p in parts))


# --- the file beside the manifest -----------------------------------------------------------------------------


def statistics_bytes(statistics: DatasetStatistics) -> tuple[bytes, str]:
    """The bytes of statistics.json and their sha256 (which the manifest records)."""
    payload = statistics.to_json().encode()
    return payload, hashlib.sha256(payload).hexdigest()


def load_statistics(manifest: Manifest, storage_options: dict[str, Any] | None = None) -> DatasetStatistics | None:
    """The dataset's statistics.json, checked against the manifest's hash; None for a dataset without one.

    Raises:
        ValueError: when statistics.json does not match the sha256 the manifest records.
    """
    if not manifest.statistics_sha256:
        return None
    fs, path = storage.get_fs(storage.join(manifest.dataset_uri, STATISTICS_NAME), storage_options)
    with fs.open(path, "rb") as handle:
        payload = handle.read()
    if hashlib.sha256(payload).hexdigest() != manifest.statistics_sha256:
        raise ValueError(f"{STATISTICS_NAME} of {manifest.dataset_uri} does not match the sha256 its manifest "
                         "records; convert the source again")
    return DatasetStatistics.model_validate_json(payload)
