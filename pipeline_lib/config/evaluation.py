"""`evaluation`: the metrics, the slices and the gate."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Literal

from pydantic import Field, SerializationInfo, field_validator, model_serializer

from pipeline_lib.config.base import Direction, Task, _Frozen


@dataclasses.dataclass(frozen=True)
class TaskMetrics:
    """What a task computes and, when the config leaves them out, what it reports and gates on."""

    computed: tuple[str, ...]  # every metric evaluation computes for the task
    default_metrics: tuple[str, ...]  # `evaluation.metrics` when omitted
    default_gate_metric: str  # `evaluation.gate.metric` when omitted (also the best-checkpoint selection's)


# The one table of task-dependent defaults: PipelineConfig fills the omitted keys from it, the gate resolves a
# GateConfig used on its own from it.
TASK_METRICS = {
    Task.CLASSIFICATION: TaskMetrics(("loss", "accuracy", "auc", "confusion_matrix"), ("loss", "accuracy", "auc"),
                                     "accuracy"),
    Task.REGRESSION: TaskMetrics(("loss", "mae", "rmse", "r2"), ("loss", "mae", "rmse", "r2"), "rmse"),
}
NON_SCALAR_METRICS = frozenset({"confusion_matrix"})


def _derived_as_none(model: _Frozen, data: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    """A dump writes a task-derived value the config left out as None, so that whoever loads the dump derives it
    again from `model.task` (which an override may have changed) instead of taking it as the user's choice."""
    for key in keys:
        if key not in model.model_fields_set and key in data:
            data[key] = None
    return data


def _unset(model: _Frozen, key: str) -> bool:
    return key not in model.model_fields_set or getattr(model, key) is None


class GateConfig(_Frozen):
    metric: str | None = None  # None: the task's (accuracy for classification, rmse for regression)
    """what "better" means: one of the task's metrics (anything else is a config error naming the task and what
    fits); `loss`, `mae`, `rmse` are always minimised, any other metric goes in `direction` (`max`)"""
    direction: Direction = Direction.MAX  # for metrics without a fixed direction (loss, mae, rmse: always min)
    """what "better" means: one of the task's metrics (anything else is a config error naming the task and what
    fits); `loss`, `mae`, `rmse` are always minimised, any other metric goes in `direction` (`max`)"""
    threshold: float | None = None  # the challenger must reach this to be blessed at all
    """minimum to pass the gate"""
    min_improvement: float = Field(0.0, ge=0.0)  # over the champion, on `metric`
    """margin a model needs over the current champion on the gate metric, on the same eval split"""
    # Every slice of `evaluation.slices` with at least `min_slice_examples` examples must reach this on `metric`.
    slice_threshold: float | None = None
    """every slice with at least `min_slice_examples` examples must reach this on the gate metric, or the model
    is not blessed (the reason names the slice)"""
    min_slice_examples: int = Field(30, ge=1)
    """every slice with at least `min_slice_examples` examples must reach this on the gate metric, or the model
    is not blessed (the reason names the slice)"""
    # Bless only a model that beats the trivial predictor (the train split's majority class or mean) on `metric`
    # by more than `baseline_margin`, on the same eval split.
    beat_baseline: bool = True
    """bless only a model that beats the trivial predictor (the train split's majority class, or its mean for a
    regression) on the gate metric, on the same eval split, by more than the margin"""
    baseline_margin: float = Field(0.0, ge=0.0)
    """bless only a model that beats the trivial predictor (the train split's majority class, or its mean for a
    regression) on the gate metric, on the same eval split, by more than the margin"""

    @model_serializer(mode="wrap")
    def _dump(self, handler: Any, info: SerializationInfo) -> dict[str, Any]:
        return _derived_as_none(self, handler(self), ("metric",))

    def for_task(self, task: Task | str) -> GateConfig:
        """This gate with an omitted `metric` filled from the task (it stays omitted in dumps).

        Raises:
            ValueError: when `metric` is not a scalar metric the task computes.
        """
        task = Task(task)
        table = TASK_METRICS[task]
        if _unset(self, "metric"):
            return _filled(self, {"metric": table.default_gate_metric}, derived=("metric",))
        fits = [m for m in table.computed if m not in NON_SCALAR_METRICS]
        if self.metric not in fits:
            raise ValueError(
                f"evaluation.gate.metric ({self.metric!r}) is not a metric model.task {task.value} computes; "
                f"choose one of {fits} (or leave it out: {table.default_gate_metric!r})"
            )
        return self


def _filled(model: Any, values: dict[str, Any], derived: tuple[str, ...]) -> Any:
    """`model` with `values` filled in, those of them in `derived` still counted as omitted (not in
    `model_fields_set`); a derived key the config set itself stays set."""
    explicit = (model.model_fields_set | set(values)) - (set(derived) & set(values))
    filled = model.model_copy(update=values)
    object.__setattr__(filled, "__pydantic_fields_set__", explicit)
    return filled


class BucketSlice(_Frozen):
    """Slices of a numeric feature by bucket boundaries: [18, 35, 65] → <18, [18,35), [35,65), ≥65."""

    feature: str
    """The numeric feature whose values are bucketed into slices"""
    boundaries: tuple[float, ...] = Field(min_length=1)
    """Increasing bucket boundaries: [18, 35, 65] makes <18, [18,35), [35,65) and >=65"""

    @field_validator("boundaries")
    @classmethod
    def _increasing(cls, value: tuple[float, ...]) -> tuple[float, ...]:
        if any(b <= a for a, b in itertools.pairwise(value)):
            raise ValueError(f"bucket boundaries {list(value)} must increase strictly, e.g. [18, 35, 65]")
        return value


# A slice: feature keys (one slice per combination of their values) or a bucketed numeric feature.
SliceSpec = tuple[str, ...] | BucketSlice


class EvaluationConfig(_Frozen):
    metrics: tuple[str, ...] | None = None  # None: the task's (loss, accuracy, auc / loss, mae, rmse, r2)
    """what the run reports: classification `loss`, `accuracy`, `auc`, `confusion_matrix`; regression `loss`,
    `mae`, `rmse`, `r2` (the confusion matrix is always in the report); a metric of the other task, or a list
    without the gate metric, is a config error"""
    select: Literal["best", "latest"] = "best"
    """export the `best` checkpoint by the gate metric (`eval_<metric>` the trainer records; `auc` ranks by
    `eval_loss`), or the `latest`"""
    gate: GateConfig = GateConfig()
    """The blessing gate: the metric, its threshold, the champion and the trivial baseline to beat"""
    # Metrics per slice of the eval split: [["region"], ["region", "device"], {feature: age, boundaries: [18, 35]}].
    slices: tuple[SliceSpec, ...] = ()
    """metrics per slice of the eval split: feature keys (`[["region"], ["region", "device"]]`, one slice per
    combination of values) or a numeric feature by bucket boundaries (`{feature: age, boundaries: [18, 35,
    65]}` → `<18`, `[18,35)`, `[35,65)`, `≥65`)"""
    # Retrain-only convenience: the gate's margin, also accepted at this level.
    min_improvement: float | None = Field(None, ge=0.0)
    """margin a model needs over the current champion on the gate metric, on the same eval split"""
    # The model check before registration (`serving.validation`): the export loaded in a fresh process through the
    # public loaders must predict what the trained model does; a model that fails it is not blessed.
    validate_model: bool = True
    """the model check before registration (the `validate_model` stage): the export must load in a fresh process
    without tfdag and predict what the trained model does, or it is not blessed"""

    @field_validator("metrics")
    @classmethod
    def _known_metrics(cls, value: tuple[str, ...] | None) -> tuple[str, ...] | None:
        allowed = {m for table in TASK_METRICS.values() for m in table.computed}
        unknown = [m for m in value or () if m not in allowed]
        if unknown:
            raise ValueError(f"unknown metric(s) {unknown}; allowed: {sorted(allowed)}")
        return value

    @field_validator("slices")
    @classmethod
    def _slice_keys(cls, value: tuple[SliceSpec, ...]) -> tuple[SliceSpec, ...]:
        for spec in value:
            if not isinstance(spec, BucketSlice) and (not spec or len(set(spec)) != len(spec)):
                raise ValueError(f"slice {list(spec)} must name one or more distinct features, e.g. ['region']")
        return value

    @model_serializer(mode="wrap")
    def _dump(self, handler: Any, info: SerializationInfo) -> dict[str, Any]:
        return _derived_as_none(self, handler(self), ("metrics",))

    def for_task(self, task: Task | str) -> EvaluationConfig:
        """This section with the omitted metrics and gate metric filled from the task (`TASK_METRICS`); what was
        filled stays omitted in `model_fields_set` and dumps, so a loaded dump derives it again.

        Raises:
            ValueError: naming the key, the task and what fits, when a metric or the gate metric does not fit it.
        """
        task = Task(task)
        table = TASK_METRICS[task]
        gate = self.gate.for_task(task)
        updates: dict[str, Any] = {"gate": gate} if gate is not self.gate else {}
        if _unset(self, "metrics"):
            updates["metrics"] = table.default_metrics
        else:
            misfits = [m for m in self.metrics if m not in table.computed]
            if misfits:
                raise ValueError(
                    f"evaluation.metrics {list(misfits)} do not fit model.task {task.value}; it computes "
                    f"{list(table.computed)} (or leave evaluation.metrics out: {list(table.default_metrics)})"
                )
            if gate.metric not in self.metrics:
                raise ValueError(
                    f"evaluation.gate.metric ({gate.metric!r}) is not among evaluation.metrics {list(self.metrics)}, "
                    f"so the run would not compute it; add it there, or gate on one of those"
                )
        return _filled(self, updates, derived=("metrics",)) if updates else self

    @property
    def effective_min_improvement(self) -> float:
        return self.min_improvement if self.min_improvement is not None else self.gate.min_improvement
