"""`evaluation`: the metrics, the slices and the gate."""

from __future__ import annotations

import itertools
from typing import Literal

from pydantic import Field, field_validator

from pipeline_lib.config.base import Direction, _Frozen


class GateConfig(_Frozen):
    metric: str = "accuracy"
    direction: Direction = Direction.MAX
    threshold: float | None = None  # the challenger must reach this to be blessed at all
    min_improvement: float = Field(0.0, ge=0.0)  # over the champion, on `metric`
    # Every slice of `evaluation.slices` with at least `min_slice_examples` examples must reach this on `metric`.
    slice_threshold: float | None = None
    min_slice_examples: int = Field(30, ge=1)


class BucketSlice(_Frozen):
    """Slices of a numeric feature by bucket boundaries: [18, 35, 65] → <18, [18,35), [35,65), ≥65."""

    feature: str
    boundaries: tuple[float, ...] = Field(min_length=1)

    @field_validator("boundaries")
    @classmethod
    def _increasing(cls, value: tuple[float, ...]) -> tuple[float, ...]:
        if any(b <= a for a, b in itertools.pairwise(value)):
            raise ValueError(f"bucket boundaries {list(value)} must increase strictly, e.g. [18, 35, 65]")
        return value


# A slice: feature keys (one slice per combination of their values) or a bucketed numeric feature.
SliceSpec = tuple[str, ...] | BucketSlice


class EvaluationConfig(_Frozen):
    metrics: tuple[str, ...] = ("loss", "accuracy", "auc")
    select: Literal["best", "latest"] = "best"
    gate: GateConfig = GateConfig()
    # Metrics per slice of the eval split: [["region"], ["region", "device"], {feature: age, boundaries: [18, 35]}].
    slices: tuple[SliceSpec, ...] = ()
    # Retrain-only convenience: the gate's margin, also accepted at this level.
    min_improvement: float | None = Field(None, ge=0.0)
    # The model check before registration (`serving.validation`): the export loaded in a fresh process through the
    # public loaders must predict what the trained model does; a model that fails it is not blessed.
    validate_model: bool = True

    @field_validator("metrics")
    @classmethod
    def _known_metrics(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        allowed = {"loss", "accuracy", "auc", "mae", "rmse", "confusion_matrix"}
        unknown = [m for m in value if m not in allowed]
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

    @property
    def effective_min_improvement(self) -> float:
        return self.min_improvement if self.min_improvement is not None else self.gate.min_improvement
