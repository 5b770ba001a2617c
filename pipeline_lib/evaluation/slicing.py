"""Metrics per slice of the eval split (TFMA's slicing): by the values of feature keys, or by buckets of a numeric
feature, each slice with its example count.

A slice spec is a tuple of feature names (`("region",)`, `("region", "device")`: one slice per combination of
values present) or a `BucketSlice` (`age` cut at `[18, 35, 65]`: `<18`, `[18,35)`, `[35,65)`, `≥65`).
"""

from __future__ import annotations

import itertools
import json
import math
import re
from collections.abc import Callable, Mapping, Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict

from pipeline_lib.config import BucketSlice, SliceSpec
from pipeline_lib.core.errors import UserError

# MLflow metric names allow word characters, `.`, `-`, ` `, `:` and `/` only: `=` is written `:` there.
_UNSAFE = re.compile(r"[^\w.\- ]")


class SliceError(UserError, ValueError):
    """`evaluation.slices` names a feature the data does not have, or one that cannot be sliced as asked."""


class SliceResult(BaseModel):
    """The metrics of one slice: `region=eu, device=mobile` with its example count."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    spec: str  # "region" or "region, device" or "age (buckets)"
    key: str  # "region=eu, device=mobile" or "age=[18,35)"
    values: dict[str, str]  # feature → value (or bucket)
    num_examples: int
    metrics: dict[str, float]

    def metric_name(self, metric: str) -> str:
        """`slice.region:eu.device:mobile.accuracy`, the MLflow metric name of one of this slice's metrics."""
        parts = [f"{_UNSAFE.sub('_', f)}:{_UNSAFE.sub('_', v)}" for f, v in self.values.items()]
        return "slice." + ".".join(parts) + f".{metric}"


def spec_features(spec: SliceSpec) -> tuple[str, ...]:
    return (spec.feature,) if isinstance(spec, BucketSlice) else tuple(spec)


def describe_spec(spec: SliceSpec) -> str:
    if isinstance(spec, BucketSlice):
        return f"{spec.feature} (buckets {', '.join(f'{b:g}' for b in spec.boundaries)})"
    return ", ".join(spec)


def check_slices(slices: Sequence[SliceSpec], numeric: Sequence[str], strings: Sequence[str]) -> None:
    """Every feature a slice names exists, and a bucketed feature is numeric.

    Raises:
        SliceError: naming the slice, the feature and the features the data has.
    """
    known = set(numeric) | set(strings)
    for index, spec in enumerate(slices):
        for feature in spec_features(spec):
            if feature not in known:
                raise SliceError(
                    f"evaluation.slices[{index}] ({describe_spec(spec)}) names feature {feature!r}, which the data "
                    f"does not have; use one of {sorted(known)}")
        if isinstance(spec, BucketSlice) and spec.feature not in set(numeric):
            raise SliceError(
                f"evaluation.slices[{index}] buckets {spec.feature!r}, a string feature; bucket a numeric feature, "
                f"or slice by its values with [{spec.feature!r}]")


def _bucket_labels(values: np.ndarray, boundaries: Sequence[float]) -> np.ndarray:
    edges = list(boundaries)
    names = [f"<{edges[0]:g}"] + [f"[{lo:g},{hi:g})" for lo, hi in itertools.pairwise(edges)] + [f"≥{edges[-1]:g}"]
    index = np.searchsorted(np.asarray(edges, dtype=np.float64), values.astype(np.float64), side="right")
    return np.asarray(names, dtype=object)[index]


def _column_values(column: np.ndarray) -> np.ndarray:
    """One printable value per example (the first element of a multi-valued feature)."""
    column = np.asarray(column)
    if column.ndim > 1:
        column = column.reshape(len(column), -1)[:, 0]
    if column.dtype.kind in "SO":
        return np.asarray([v.decode() if isinstance(v, bytes) else str(v) for v in column], dtype=object)
    if column.dtype.kind == "f" and np.all(np.mod(column, 1) == 0):
        column = column.astype(np.int64)
    return column.astype(str).astype(object)


def compute_slices(slices: Sequence[SliceSpec], columns: Mapping[str, np.ndarray], labels: np.ndarray,
                   outputs: np.ndarray, score: Callable[[np.ndarray, np.ndarray], dict[str, float]]
                   ) -> list[SliceResult]:
    """Every metric of the task per slice, in the order of `slices` then by key.

    Args:
        slices: `evaluation.slices`.
        columns: feature name → per-example values (the eval split, aligned with `labels`).
        labels: the labels, shape [n].
        outputs: the model outputs, shape [n, units].
        score: the task's metrics of (labels, outputs), the same function as for the whole split.
    """
    results = []
    for spec in slices:
        if isinstance(spec, BucketSlice):
            per_feature = {spec.feature: _bucket_labels(np.asarray(columns[spec.feature]).reshape(len(labels), -1)[:, 0],
                                                        spec.boundaries)}
        else:
            per_feature = {feature: _column_values(columns[feature]) for feature in spec}
        keys = np.asarray(["\x1f".join(parts) for parts in zip(*per_feature.values())], dtype=object)
        for key in sorted(set(keys.tolist())):
            mask = keys == key
            values = dict(zip(per_feature, key.split("\x1f")))
            metrics = score(labels[mask], outputs[mask])
            results.append(SliceResult(spec=describe_spec(spec), key=", ".join(f"{f}={v}" for f, v in values.items()),
                                       values=values, num_examples=int(mask.sum()), metrics=metrics))
    return results


def slices_to_json(results: Sequence[SliceResult]) -> str:
    payload = [{**r.model_dump(mode="json"),
                "metrics": {k: (None if math.isnan(v) else v) for k, v in r.metrics.items()}} for r in results]
    return json.dumps(payload, indent=2)


def slices_to_markdown(results: Sequence[SliceResult], failing: Sequence[str] = ()) -> str:
    """One table per slice spec: key, examples and every metric; slices that failed the gate are marked."""
    lines = ["# Metrics per slice of the eval split", ""]
    for spec in dict.fromkeys(r.spec for r in results):
        rows = [r for r in results if r.spec == spec]
        names = list(rows[0].metrics)
        lines += [f"## {spec}", "", "| slice | examples | " + " | ".join(names) + " |",
                  "|---|---|" + "---|" * len(names)]
        for r in rows:
            mark = " ✗" if r.key in failing else ""
            lines.append(f"| {r.key}{mark} | {r.num_examples} | "
                         + " | ".join("n/a" if math.isnan(r.metrics[n]) else f"{r.metrics[n]:.4f}" for n in names)
                         + " |")
        lines.append("")
    if failing:
        lines += [f"✗ below `evaluation.gate.slice_threshold`: {', '.join(failing)}", ""]
    return "\n".join(lines)
