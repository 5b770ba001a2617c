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

import collections
import concurrent.futures
import hashlib
import math
from collections.abc import Iterable
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel, ConfigDict

from pipeline_lib.core import storage
from pipeline_lib.data.manifest import DType, Manifest

STATISTICS_NAME = "statistics.json"
MISSING_INT64 = -(1 << 63)  # a missing int64 value in the records; the input pipeline reads it as NaN
MAX_TRACKED_VALUES = 10_000
TOP_VALUES = 10  # shown in reports
_SHIFT = 18  # float32 bits >> 18 keeps sign, exponent and 5 mantissa bits
_NUM_KEYS = 1 << (31 - _SHIFT)


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


def bucket_key(values: np.ndarray) -> np.ndarray:
    """The sketch bucket of each float32 value: its top bits, negated (minus one) for negative values."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    magnitude = ((bits & np.uint32(0x7FFFFFFF)) >> np.uint32(_SHIFT)).astype(np.int64)
    return np.where(bits >> np.uint32(31) == 1, -magnitude - 1, magnitude)


def bucket_value(key: int) -> float:
    """The middle of a sketch bucket."""
    magnitude = key if key >= 0 else -key - 1
    low = np.array([magnitude << _SHIFT], dtype=np.uint32).view(np.float32)[0]
    high = np.array([(magnitude + 1) << _SHIFT], dtype=np.uint32).view(np.float32)[0]
    middle = (float(low) + float(high)) / 2 if math.isfinite(float(high)) else float(low)
    return middle if key >= 0 else -middle


# --- accumulation ---------------------------------------------------------------------------------------------


class NumericAccumulator:
    """Adds chunks of one numeric column; `result()` is the frozen NumericStatistics."""

    def __init__(self) -> None:
        self.count = self.missing = 0
        self.mean = self.m2 = 0.0
        self.min = math.inf
        self.max = -math.inf
        # bits >> _SHIFT of a float32: [0, _NUM_KEYS) for positive values, [_NUM_KEYS, 2 * _NUM_KEYS) for negative.
        self.keys = np.zeros(2 * _NUM_KEYS, dtype=np.int64)

    def add(self, values: np.ndarray) -> None:
        """Add a chunk: float32 or int64 values, scalars or vectors (NaN and MISSING_INT64 count as missing)."""
        flat = np.asarray(values).reshape(-1)
        if not flat.size:
            return
        # Few passes over the values: this runs on every column of every chunk of the conversion.
        if flat.dtype.kind == "f":
            total = float(flat.sum(dtype=np.float64))
            if math.isnan(total):  # only then a pass to find the missing values
                present = ~np.isnan(flat)
                self.missing += int(flat.size - np.count_nonzero(present))
                flat = flat[present]
                total = float(flat.sum(dtype=np.float64))
        else:
            missing = flat == MISSING_INT64
            if missing.any():
                self.missing += int(np.count_nonzero(missing))
                flat = flat[~missing]
            total = float(flat.sum(dtype=np.float64))
        if not flat.size:
            return
        mean = total / flat.size
        deviations = flat.astype(np.float64)
        deviations -= mean
        m2 = float(np.dot(deviations, deviations))
        self._merge(flat.size, mean, m2, float(flat.min()), float(flat.max()))
        bits = np.ascontiguousarray(flat, dtype=np.float32).view(np.uint32)
        self.keys += np.bincount((bits >> np.uint32(_SHIFT)).view(np.int32), minlength=2 * _NUM_KEYS)

    def add_sums(self, count: int, mean: float, m2: float, low: float, high: float, keys: np.ndarray) -> None:
        """Add a chunk already reduced (see `add_float_matrix`): no missing values among its `count`."""
        self._merge(count, mean, m2, low, high)
        self.keys += keys

    def _merge(self, count: int, mean: float, m2: float, low: float, high: float) -> None:
        # Chan, Golub and LeVeque's pairwise update: exact in real arithmetic, in any order.
        total = self.count + count
        delta = mean - self.mean
        self.mean += delta * count / total
        self.m2 += m2 + delta * delta * self.count * count / total
        self.count = total
        self.min, self.max = min(self.min, low), max(self.max, high)

    def result(self) -> NumericStatistics:
        positive, negative = self.keys[:_NUM_KEYS], self.keys[_NUM_KEYS:]
        sketch = {int(k): int(positive[k]) for k in np.flatnonzero(positive)}
        sketch.update({int(-k - 1): int(negative[k]) for k in np.flatnonzero(negative)})
        if not self.count:
            return NumericStatistics(count=0, missing=self.missing)
        return NumericStatistics(count=self.count, missing=self.missing, min=self.min, max=self.max,
                                 mean=self.mean, variance=self.m2 / self.count, sketch=sketch)


def add_float_matrix(accumulators: list[NumericAccumulator], matrix: np.ndarray) -> None:
    """Add a (rows, k) float32 matrix, column j to `accumulators[j]`: each reduction runs once over the whole
    matrix, which costs far less per value than k passes over single columns (the common wide-table case)."""
    num_rows = matrix.shape[0]
    if not num_rows:
        return
    sums = matrix.sum(axis=0, dtype=np.float64)
    with_missing = np.flatnonzero(np.isnan(sums))
    if len(with_missing):  # rare: those columns one by one, the others together
        for j in with_missing.tolist():
            accumulators[j].add(matrix[:, j])
        keep = np.flatnonzero(~np.isnan(sums))
        if not len(keep):
            return
        add_float_matrix([accumulators[j] for j in keep.tolist()], np.ascontiguousarray(matrix[:, keep]))
        return
    means = sums / num_rows
    deviations = matrix.astype(np.float64)
    deviations -= means
    m2 = np.einsum("ij,ij->j", deviations, deviations)
    del deviations
    lows, highs = matrix.min(axis=0), matrix.max(axis=0)
    width = matrix.shape[1]
    keys = (np.ascontiguousarray(matrix).view(np.uint32) >> np.uint32(_SHIFT)).view(np.int32)
    keys += (np.arange(width, dtype=np.int32) * (2 * _NUM_KEYS))[None, :]
    counts = np.bincount(keys.reshape(-1), minlength=width * 2 * _NUM_KEYS).reshape(width, 2 * _NUM_KEYS)
    for j, accumulator in enumerate(accumulators):
        accumulator.add_sums(num_rows, float(means[j]), float(m2[j]), float(lows[j]), float(highs[j]), counts[j])


class StringAccumulator:
    """Adds chunks of one string column (Arrow binary arrays); `result()` is the frozen StringStatistics."""

    def __init__(self) -> None:
        self.count = self.missing = 0
        self.values: dict[str, int] = {}
        self.truncated = False

    def add(self, values: Any) -> None:
        if isinstance(values, pa.ChunkedArray):
            values = values.combine_chunks()
        if not isinstance(values, pa.Array):
            values = pa.array([v.encode() if isinstance(v, str) else v for v in np.asarray(values).tolist()],
                              pa.binary())
        counts = pc.value_counts(values)
        keys = counts.field("values").to_pylist()
        numbers = counts.field("counts").to_numpy(zero_copy_only=False).tolist()
        for key, number in zip(keys, numbers):
            if key is None or key == b"" or key == "":
                self.missing += number
                continue
            self.count += number
            text = key.decode("utf-8", "replace") if isinstance(key, bytes) else str(key)
            self.values[text] = self.values.get(text, 0) + number
        self._trim()

    def _trim(self) -> None:
        if len(self.values) > MAX_TRACKED_VALUES:
            kept = sorted(self.values.items(), key=lambda item: (-item[1], item[0]))[:MAX_TRACKED_VALUES]
            self.values = dict(kept)
            self.truncated = True

    def result(self) -> StringStatistics:
        return StringStatistics(count=self.count, missing=self.missing, values=dict(sorted(self.values.items())),
                                truncated=self.truncated)


_CHUNKS_IN_FLIGHT = 2


class StatisticsBuilder:
    """Accumulates every column of every split over the chunks of one conversion.

    `submit` adds a chunk on a thread of its own (numpy and Arrow release the GIL), in chunk order, beside the
    encoding of the next chunk; `result` waits for every chunk submitted.
    """

    def __init__(self, dtypes: dict[str, DType], splits: Iterable[str]) -> None:
        self.dtypes = dtypes
        self.num_rows = {split: 0 for split in splits}
        self.columns = {split: {name: (StringAccumulator() if dtype == DType.STRING else NumericAccumulator())
                                for name, dtype in dtypes.items()}
                        for split in self.num_rows}
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: collections.deque[concurrent.futures.Future] = collections.deque()

    def submit(self, columns: dict[str, Any], to_eval: np.ndarray, num_eval: int) -> None:
        """`add_chunk` in the background (at most _CHUNKS_IN_FLIGHT chunks queued, which bounds memory)."""
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tfdag-stats")
        while len(self._pending) >= _CHUNKS_IN_FLIGHT:
            self._pending.popleft().result()
        self._pending.append(self._pool.submit(self.add_chunk, columns, to_eval, num_eval))

    def wait(self) -> None:
        """Until every submitted chunk is added; raises the first error of one."""
        try:
            while self._pending:
                self._pending.popleft().result()
        finally:
            if self._pool is not None and not self._pending:
                self._pool.shutdown(wait=True)
                self._pool = None

    def close(self) -> None:
        """Drop what is still queued (the conversion failed) and stop the thread."""
        for future in self._pending:
            future.cancel()
        self._pending.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def add_chunk(self, columns: dict[str, Any], to_eval: np.ndarray, num_eval: int) -> None:
        """Add one chunk's rows to the statistics of their split: `to_eval` marks the `num_eval` eval rows."""
        num_rows = len(to_eval)
        # Scalar float32 columns as one matrix: split and reduced once for all of them.
        floats = [n for n, v in columns.items() if isinstance(v, np.ndarray) and v.ndim == 1 and v.dtype == np.float32]
        matrix = np.stack([columns[n] for n in floats], axis=1) if len(floats) > 1 else None
        others = {n: v for n, v in columns.items() if matrix is None or n not in floats}
        if num_eval in (0, num_rows):
            split = "eval" if num_eval else "train"
            self.add(split, others, num_rows)
            if matrix is not None:
                self._add_floats(split, floats, matrix)
            return
        for split, rows, count in (("eval", to_eval, num_eval), ("train", ~to_eval, num_rows - num_eval)):
            arrow_rows = pa.array(rows)
            self.add(split, {name: v[rows] if isinstance(v, np.ndarray) else v.filter(arrow_rows)
                             for name, v in others.items()}, count)
            if matrix is not None:
                self._add_floats(split, floats, matrix[rows])

    def add(self, split: str, columns: dict[str, Any], num_rows: int) -> None:
        """Add the rows of one split of one chunk: column name → converted values (missing ones as in the records)."""
        if not num_rows:
            return
        self.num_rows[split] += num_rows
        for name, values in columns.items():
            self.columns[split][name].add(values)

    def _add_floats(self, split: str, names: list[str], matrix: np.ndarray) -> None:
        add_float_matrix([self.columns[split][name] for name in names], matrix)

    def result(self, label: str, imputation: dict[str, Imputation] | None = None) -> DatasetStatistics:
        self.wait()
        splits = {}
        for split, accumulators in self.columns.items():
            features = {}
            for name, accumulator in accumulators.items():
                result = accumulator.result()
                kind = "string" if isinstance(result, StringStatistics) else "numeric"
                features[name] = FeatureStatistics(dtype=self.dtypes[name], **{kind: result})
            splits[split] = SplitStatistics(num_rows=self.num_rows[split], features=features)
        return DatasetStatistics(label=label, splits=splits, imputation=imputation or {})


# --- merging the frozen form ----------------------------------------------------------------------------------


def merge_numeric(a: NumericStatistics, b: NumericStatistics) -> NumericStatistics:
    """The statistics of the union of the rows `a` and `b` describe (two shards, two files)."""
    if not b.count or not a.count:
        base = a if a.count else b
        return base.model_copy(update={"missing": a.missing + b.missing})
    total = a.count + b.count
    delta = b.mean - a.mean
    m2 = a.variance * a.count + b.variance * b.count + delta * delta * a.count * b.count / total
    sketch = dict(a.sketch)
    for key, count in b.sketch.items():
        sketch[key] = sketch.get(key, 0) + count
    return NumericStatistics(count=total, missing=a.missing + b.missing, min=min(a.min, b.min),
                             max=max(a.max, b.max), mean=a.mean + delta * b.count / total, variance=m2 / total,
                             sketch=sketch)


def merge_string(a: StringStatistics, b: StringStatistics) -> StringStatistics:
    accumulator = StringAccumulator()
    accumulator.count, accumulator.missing = a.count + b.count, a.missing + b.missing
    accumulator.values = dict(a.values)
    for key, count in b.values.items():
        accumulator.values[key] = accumulator.values.get(key, 0) + count
    accumulator.truncated = a.truncated or b.truncated
    accumulator._trim()
    return accumulator.result()


def merge_features(a: FeatureStatistics, b: FeatureStatistics) -> FeatureStatistics:
    if a.dtype != b.dtype:
        raise ValueError(f"cannot merge statistics of a {a.dtype.value} column with a {b.dtype.value} one")
    if a.numeric is not None:
        return FeatureStatistics(dtype=a.dtype, numeric=merge_numeric(a.numeric, b.numeric))
    return FeatureStatistics(dtype=a.dtype, string=merge_string(a.string, b.string))


def merge_splits(a: SplitStatistics, b: SplitStatistics) -> SplitStatistics:
    """Two splits' statistics as one (the columns of both must match)."""
    if set(a.features) != set(b.features):
        raise ValueError(f"cannot merge statistics of columns {sorted(a.features)} with {sorted(b.features)}")
    return SplitStatistics(num_rows=a.num_rows + b.num_rows,
                           features={n: merge_features(a.features[n], b.features[n]) for n in a.features})


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
