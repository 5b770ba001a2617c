"""Accumulating statistics over the chunks of a conversion: one accumulator per split and column, on a thread.

The frozen results, the sketch and the merge rules are in `statistics`; this module only adds chunks. It runs on
every value conversion writes, so a numeric column goes through one C loop per chunk for both splits
(`_native.numeric_statistics`), and through numpy only where the extension is not built.
"""

from __future__ import annotations

import collections
import concurrent.futures
import math
from collections.abc import Iterable
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline_lib.core import native
from pipeline_lib.data.manifest import DType
from pipeline_lib.data.statistics import (
    MISSING_INT64,
    NUM_SKETCH_KEYS,
    SKETCH_SHIFT,
    DatasetStatistics,
    FeatureStatistics,
    Imputation,
    NumericStatistics,
    SplitStatistics,
    StringStatistics,
    most_frequent,
)


class NumericAccumulator:
    """Adds chunks of one numeric column; `result()` is the frozen NumericStatistics."""

    def __init__(self) -> None:
        self.count = self.missing = 0
        self.mean = self.m2 = 0.0
        self.min = math.inf
        self.max = -math.inf
        # bits >> SKETCH_SHIFT of a float32: [0, NUM_SKETCH_KEYS) for positive values, [NUM_SKETCH_KEYS, 2 * NUM_SKETCH_KEYS) for negative.
        self.keys = np.zeros(2 * NUM_SKETCH_KEYS, dtype=np.int64)

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
        self.keys += np.bincount((bits >> np.uint32(SKETCH_SHIFT)).view(np.int32), minlength=2 * NUM_SKETCH_KEYS)

    def _merge(self, count: int, mean: float, m2: float, low: float, high: float) -> None:
        # Chan, Golub and LeVeque's pairwise update: exact in real arithmetic, in any order.
        total = self.count + count
        delta = mean - self.mean
        self.mean += delta * count / total
        self.m2 += m2 + delta * delta * self.count * count / total
        self.count = total
        self.min, self.max = min(self.min, low), max(self.max, high)

    def result(self) -> NumericStatistics:
        positive, negative = self.keys[:NUM_SKETCH_KEYS], self.keys[NUM_SKETCH_KEYS:]
        present, below = np.flatnonzero(positive), np.flatnonzero(negative)
        sketch = dict(zip(present.tolist(), positive[present].tolist()))
        sketch.update(zip((-below - 1).tolist(), negative[below].tolist()))
        if not self.count:
            return NumericStatistics(count=0, missing=self.missing)
        return NumericStatistics(count=self.count, missing=self.missing, min=self.min, max=self.max,
                                 mean=self.mean, variance=self.m2 / self.count, sketch=sketch)


def add_numeric_splits(train: NumericAccumulator, eval_: NumericAccumulator, values: np.ndarray,
                       split: np.ndarray | int) -> None:
    """Add a chunk of one numeric column to both splits: `split` is each row's (True: eval), or 0 or 1 for all.

    One C loop (`_native.numeric_statistics`) over the values, with no copy per split; without the extension,
    each split's rows through `NumericAccumulator.add`. Both give the same counts, extremes and sketch, and the
    same mean and variance up to the order of the float64 additions.
    """
    values = np.ascontiguousarray(values)
    if native.module is None or values.dtype not in (np.float32, np.int64):
        if isinstance(split, int):
            (eval_ if split else train).add(values)
        else:
            eval_.add(values[split])
            train.add(values[~split])
        return
    sums = native.module.numeric_statistics(values, split, train.keys, eval_.keys, SKETCH_SHIFT)
    for accumulator, (count, missing, mean, m2, low, high) in zip((train, eval_), sums):
        accumulator.missing += missing
        if count:
            accumulator._merge(count, mean, m2, low, high)


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
        if self.truncated:  # a high-cardinality column: count the tracked values only, without a Python loop
            self._add_tracked(values, counts)
            return
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

    def _add_tracked(self, values: pa.Array, counts: pa.StructArray) -> None:
        missing = int(values.null_count) + int(pc.sum(pc.equal(pc.binary_length(values), 0)).as_py() or 0)
        self.missing += missing
        self.count += len(values) - missing
        tracked = list(self.values)
        value_set = pa.array([t.encode("utf-8") for t in tracked], pa.binary())
        where = pc.index_in(pc.cast(counts.field("values"), pa.binary()), value_set=value_set)
        found = where.is_valid().to_numpy(zero_copy_only=False)
        if found.any():
            indices = where.to_numpy(zero_copy_only=False)[found].astype(np.int64)
            numbers = counts.field("counts").to_numpy(zero_copy_only=False)[found]
            added = np.bincount(indices, weights=numbers, minlength=len(tracked))
            for index in np.flatnonzero(added).tolist():
                self.values[tracked[index]] += int(added[index])

    def _trim(self) -> None:
        self.values, cut = most_frequent(self.values)
        self.truncated = self.truncated or cut

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
        split: np.ndarray | int = to_eval if 0 < num_eval < num_rows else int(num_eval > 0)
        arrow_rows = {}  # the Arrow masks of each split, made once for all string columns
        for name, values in columns.items():
            train, eval_ = self.columns["train"][name], self.columns["eval"][name]
            if isinstance(train, NumericAccumulator):
                add_numeric_splits(train, eval_, values, split)
            elif isinstance(split, int):
                (eval_ if split else train).add(values)
            else:
                if not arrow_rows:
                    arrow_rows = {"eval": pa.array(to_eval), "train": pa.array(~to_eval)}
                eval_.add(values.filter(arrow_rows["eval"]))
                train.add(values.filter(arrow_rows["train"]))
        self.num_rows["eval"] += num_eval
        self.num_rows["train"] += num_rows - num_eval

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
