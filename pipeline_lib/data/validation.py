"""Data validation before training: this conversion's schema and statistics against a baseline's, as anomalies.

The checks (TFDV's ExampleValidator, on tfdag's statistics), each on the train splits:

- `new_column` / `missing_column`: a feature or the label the baseline did not have, or lacks now;
- `type_change`: a column's dtype or shape changed;
- `missing_rate`: a column's share of missing values rose by more than `validation.max_missing_rate_increase`;
- `unseen_values`: more than `validation.max_unseen_share` of a string column's rows hold a value the baseline
  never saw;
- `drift`: the Jensen-Shannon divergence (base 2) of a numeric column's distribution, over the baseline's
  deciles, or the L-infinity distance of a string column's value shares, above `validation.drift`. A date or
  timestamp column is exempt: its instants move on with every new batch of data, so they would drift on every
  retrain (its missing rate and type are still checked).

Every anomaly has a name, `<kind>:<column>`, that `validation.allow` accepts (`<kind>:*` for every column).

`check_label`, whatever `validation` says, refuses a label with one value in the train split before training.
"""

from __future__ import annotations

import fnmatch
import math

from pydantic import BaseModel, ConfigDict

from pipeline_lib.config import Task, ValidationConfig
from pipeline_lib.core.errors import UserError
from pipeline_lib.data.manifest import DType, FeatureSpec, Schema
from pipeline_lib.data.statistics import (
    DatasetStatistics,
    FeatureStatistics,
    NumericStatistics,
    StringStatistics,
    bucket_value,
)

NUM_DRIFT_BINS = 10


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class DataValidationError(UserError, ValueError):
    """The data differs from the baseline in ways `validation.allow` does not accept; training does not start."""


class LabelError(UserError, ValueError):
    """The label cannot train a model (one value in the train split); training does not start."""


class Anomaly(_Frozen):
    kind: str  # new_column, missing_column, type_change, missing_rate, unseen_values, drift
    column: str
    observed: str
    expected: str
    fix: str
    allowed: bool = False

    @property
    def name(self) -> str:
        return f"{self.kind}:{self.column}"

    def describe(self) -> str:
        """One line: name, observed, expected and the fix."""
        return (f"{self.name}: observed {self.observed}, expected {self.expected}; {self.fix}"
                + (" (allowed by validation.allow)" if self.allowed else ""))


class ValidationReport(_Frozen):
    baseline: str  # e.g. "run 1a2b… (latest successful run of pipeline 'wine')" or "none"
    anomalies: tuple[Anomaly, ...] = ()

    @property
    def blocking(self) -> tuple[Anomaly, ...]:
        return tuple(a for a in self.anomalies if not a.allowed)

    def to_markdown(self) -> str:
        lines = [f"# Data validation\n\n**Baseline:** {self.baseline}\n"]
        if not self.anomalies:
            lines.append("No anomaly: the data matches the baseline.\n")
            return "\n".join(lines)
        lines += ["| anomaly | column | observed | expected | fix | allowed |", "|---|---|---|---|---|---|"]
        for a in self.anomalies:
            lines.append(f"| `{a.kind}` | `{a.column}` | {a.observed} | {a.expected} | {a.fix} | "
                         f"{'yes' if a.allowed else 'no'} |")
        return "\n".join(lines) + "\n"

    def raise_if_blocking(self) -> None:
        """Raises DataValidationError, one line per anomaly, when an anomaly is not allowed."""
        if self.blocking:
            raise DataValidationError(
                f"{len(self.blocking)} data anomal{'y' if len(self.blocking) == 1 else 'ies'} against the baseline "
                f"({self.baseline}); training did not start:\n  - "
                + "\n  - ".join(a.describe() for a in self.blocking))


def _columns(schema: Schema) -> dict[str, FeatureSpec]:
    return {spec.name: spec for spec in (*schema.features, schema.label)}


def _describe_type(spec: FeatureSpec) -> str:
    if spec.time is not None:
        return spec.time.value
    return f"{spec.dtype.value}{list(spec.shape) if spec.shape else ''}"


def _allow_fix(name: str) -> str:
    return f"if this is expected, add {name!r} to validation.allow"


def _mass_by_bin(stats: NumericStatistics, edges: list[float]) -> list[float]:
    """The share of `stats`' values below the first edge, between each pair of edges, and above the last."""
    masses = [0.0] * (len(edges) + 1)
    for key, count in stats.sketch.items():
        value = bucket_value(key)
        index = sum(1 for edge in edges if value > edge)
        masses[index] += count
    total = sum(masses) or 1.0
    return [m / total for m in masses]


def jensen_shannon(p: list[float], q: list[float]) -> float:
    """The base-2 Jensen-Shannon divergence of two distributions over the same bins (0: equal, 1: disjoint)."""
    divergence = 0.0
    for a, b in zip(p, q):
        m = (a + b) / 2
        if a > 0:
            divergence += 0.5 * a * math.log2(a / m)
        if b > 0:
            divergence += 0.5 * b * math.log2(b / m)
    return max(0.0, divergence)


def numeric_drift(current: NumericStatistics, baseline: NumericStatistics) -> float | None:
    """Jensen-Shannon divergence over the baseline's deciles (plus the two tails beyond its range)."""
    if not current.count or not baseline.count:
        return None
    edges = sorted({baseline.quantile(i / NUM_DRIFT_BINS) for i in range(NUM_DRIFT_BINS + 1)})
    return jensen_shannon(_mass_by_bin(current, edges), _mass_by_bin(baseline, edges))


def _shares(stats: StringStatistics) -> dict[str, float]:
    return {value: count / stats.count for value, count in stats.values.items()} if stats.count else {}


def string_drift(current: StringStatistics, baseline: StringStatistics) -> float | None:
    """L-infinity distance: the largest change in the share of one value (among the present values)."""
    if not current.count or not baseline.count:
        return None
    a, b = _shares(current), _shares(baseline)
    return max(abs(a.get(v, 0.0) - b.get(v, 0.0)) for v in set(a) | set(b))


def _column_anomalies(name: str, current: FeatureStatistics, baseline: FeatureStatistics,
                      config: ValidationConfig, *, drift: bool = True) -> list[Anomaly]:
    found = []
    rise = current.missing_rate - baseline.missing_rate
    if rise > config.max_missing_rate_increase:
        found.append(Anomaly(
            kind="missing_rate", column=name, observed=f"{current.missing_rate:.1%} missing",
            expected=f"at most {baseline.missing_rate + config.max_missing_rate_increase:.1%} (baseline "
                     f"{baseline.missing_rate:.1%} + validation.max_missing_rate_increase)",
            fix=f"check where the empty values come from; {_allow_fix(f'missing_rate:{name}')}"))
    if current.string is not None and baseline.string is not None:
        if not baseline.string.truncated:
            unseen = {v: c for v, c in current.string.values.items() if v not in baseline.string.values}
            total = current.count + current.missing
            share = sum(unseen.values()) / total if total else 0.0
            if share > config.max_unseen_share:
                examples = ", ".join(repr(v) for v, _ in sorted(unseen.items(), key=lambda i: -i[1])[:3])
                found.append(Anomaly(
                    kind="unseen_values", column=name, observed=f"{share:.1%} of rows hold unseen values ({examples})",
                    expected=f"at most {config.max_unseen_share:.1%} (validation.max_unseen_share)",
                    fix=f"the model maps unseen values to out-of-vocabulary; {_allow_fix(f'unseen_values:{name}')}"))
        distance = string_drift(current.string, baseline.string)
        if distance is not None and distance > config.drift.l_infinity:
            found.append(Anomaly(
                kind="drift", column=name, observed=f"L-infinity distance {distance:.3f}",
                expected=f"at most {config.drift.l_infinity} (validation.drift.l_infinity)",
                fix=f"the value shares changed; {_allow_fix(f'drift:{name}')}"))
    elif drift and current.numeric is not None and baseline.numeric is not None:
        divergence = numeric_drift(current.numeric, baseline.numeric)
        if divergence is not None and divergence > config.drift.jensen_shannon:
            c, b = current.numeric, baseline.numeric
            found.append(Anomaly(
                kind="drift", column=name,
                observed=f"Jensen-Shannon divergence {divergence:.3f} (mean {c.mean:.4g}, range {c.min:.4g}..{c.max:.4g})",
                expected=f"at most {config.drift.jensen_shannon} (validation.drift.jensen_shannon; baseline mean "
                         f"{b.mean:.4g}, range {b.min:.4g}..{b.max:.4g})",
                fix=f"check the column's units and source; {_allow_fix(f'drift:{name}')}"))
    return found


def validate_statistics(schema: Schema, statistics: DatasetStatistics, baseline_schema: Schema,
                        baseline_statistics: DatasetStatistics, config: ValidationConfig,
                        baseline: str = "the baseline") -> ValidationReport:
    """The anomalies of this conversion's train split against the baseline's, each marked allowed or not.

    Args:
        schema, statistics: this conversion's.
        baseline_schema, baseline_statistics: the baseline run's.
        config: the `validation` section (thresholds and `allow`).
        baseline: what the baseline is, for the report.
    """
    found: list[Anomaly] = []
    now, before = _columns(schema), _columns(baseline_schema)
    for name in now.keys() - before.keys():
        found.append(Anomaly(kind="new_column", column=name, observed=f"column {name!r} ({_describe_type(now[name])})",
                             expected="no such column",
                             fix=f"leave it out with data.features, or {_allow_fix(f'new_column:{name}')}"))
    for name in before.keys() - now.keys():
        found.append(Anomaly(kind="missing_column", column=name, observed="no such column",
                             expected=f"column {name!r} ({_describe_type(before[name])})",
                             fix=f"restore the column in the source, or {_allow_fix(f'missing_column:{name}')}"))
    for name in sorted(now.keys() & before.keys()):
        if _describe_type(now[name]) != _describe_type(before[name]) and name != schema.label.name:
            found.append(Anomaly(kind="type_change", column=name, observed=_describe_type(now[name]),
                                 expected=_describe_type(before[name]),
                                 fix=f"convert the column back to {_describe_type(before[name])} in the source, or "
                                     f"{_allow_fix(f'type_change:{name}')}"))
            continue
        current, previous = statistics.feature(name), baseline_statistics.feature(name)
        if current is not None and previous is not None and current.dtype == previous.dtype:
            # A time column's instants are newer on every retrain: no drift check (see the module docstring).
            found += _column_anomalies(name, current, previous, config, drift=now[name].time is None)
    marked = [a.model_copy(update={"allowed": any(fnmatch.fnmatchcase(a.name, p) for p in config.allow)})
              for a in sorted(found, key=lambda a: (a.column, a.kind))]
    return ValidationReport(baseline=baseline, anomalies=tuple(marked))


def _only_label_value(schema: Schema, statistics: DatasetStatistics | None) -> tuple[str, int | None] | None:
    """The train split's one label value (as the error shows it) and its row count, or None when it holds two or
    more (or none). Without statistics, the schema's classes: one in the vocabulary, or integer labels all 0."""
    label = statistics.feature(schema.label.name, "train") if statistics is not None else None
    if label is None:
        if schema.label_vocabulary is not None and len(schema.label_vocabulary) == 1:
            return repr(schema.label_vocabulary[0]), None
        return ("0", None) if schema.num_classes == 1 else None
    if label.string is not None:
        values = label.string.values
        if len(values) == 1 and not label.string.truncated:
            [(value, count)] = values.items()
            return repr(value), count
        return None
    numeric = label.numeric
    if numeric is None or not numeric.count or numeric.min != numeric.max:
        return None
    return (str(int(numeric.min)) if label.dtype == DType.INT64 else f"{numeric.min:.7g}"), numeric.count


def check_label(schema: Schema, statistics: DatasetStatistics | None, task: Task | str) -> None:
    """Refuse a label with one value in the train split, before any training: a classifier needs two classes to
    tell apart (its model would have one output unit, or learn to answer one class), and a regression on a
    constant label learns nothing but that constant.

    Args:
        schema: the dataset's schema (the label, its classes).
        statistics: the dataset's statistics (the train split's label values); None falls back to the schema.
        task: `model.task`.

    Raises:
        LabelError: naming the label, its one value and the fix.
    """
    only = _only_label_value(schema, statistics)
    if only is None:
        return
    value, count = only
    rows = f" on all {count} rows" if count is not None else ""
    needs = ("a classifier needs at least two classes" if Task(task) == Task.CLASSIFICATION
             else "a regression on a constant label learns nothing but the constant")
    raise LabelError(
        f"data.label {schema.label.name!r} has one value in the train split ({value}{rows}); {needs}, so training "
        "did not start; check that data.label names the column to predict, and that data.source (and "
        "data.split) give the train split rows of more than one label value")
