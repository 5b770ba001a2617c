"""`tune`: a hyperparameter search over config keys by their dotted paths, and `tune_trial`, what one trial's
config carries to report to its study.

A distribution is written as YAML writes it: `{loguniform: [lo, hi]}`, `{uniform: [lo, hi]}`,
`{int: [lo, hi], step: 16, log: false}` or `{choice: [v1, v2, ...]}` (values of any YAML kind, lists included).
The rules that need the whole config (each path exists, every end of every range validates) are in `tune_space`.
"""

from __future__ import annotations

import enum
import json
from typing import Annotated, Any

from pydantic import ConfigDict, Discriminator, Field, Tag, model_validator

from pipeline_lib.config.base import ConfigError, Direction, SecretUri, _Frozen


class Sampler(str, enum.Enum):  # `tune.sampler`
    TPE = "tpe"  # Optuna's TPESampler
    RANDOM = "random"
    GRID = "grid"  # every combination of the choices and int ranges, each once


class Pruner(str, enum.Enum):  # `tune.pruner`
    MEDIAN = "median"  # a trial worse than the median of the finished trials at the same step stops
    HYPERBAND = "hyperband"
    NONE = "none"


class LogUniform(_Frozen):
    loguniform: tuple[float, float]
    """[low, high], 0 < low < high: sampled uniformly on a log scale (a learning rate)"""

    @model_validator(mode="after")
    def _range(self) -> LogUniform:
        low, high = self.loguniform
        if not 0 < low < high:
            raise ValueError(f"needs 0 < low < high, got [{low:g}, {high:g}]; e.g. {{loguniform: [1.0e-4, 1.0e-1]}}")
        return self


class Uniform(_Frozen):
    uniform: tuple[float, float]
    """[low, high], low < high: sampled uniformly"""

    @model_validator(mode="after")
    def _range(self) -> Uniform:
        low, high = self.uniform
        if not low < high:
            raise ValueError(f"needs low < high, got [{low:g}, {high:g}]; e.g. {{uniform: [0.0, 0.5]}}")
        return self


class IntRange(_Frozen):
    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True, validate_by_name=True,
                              serialize_by_alias=True)

    int_: tuple[int, int] = Field(alias="int")
    """[low, high], both included: an integer"""
    step: int = Field(1, ge=1)
    """The spacing of the integers from low; high - low must be a whole number of steps"""
    log: bool = False
    """Sample on a log scale (step 1, low >= 1)"""

    @model_validator(mode="after")
    def _range(self) -> IntRange:
        low, high = self.int_
        if not low < high:
            raise ValueError(f"needs low < high, got [{low}, {high}]; e.g. {{int: [16, 128], step: 16}}")
        if (high - low) % self.step:
            below = low + (high - low) // self.step * self.step
            raise ValueError(f"the range [{low}, {high}] is no whole number of steps of {self.step}: {high} - {low} "
                             f"is not a multiple of {self.step}; end it at {below} or {below + self.step}")
        if self.log and (low < 1 or self.step != 1):
            raise ValueError(f"log: true samples a range of positive integers by step 1, got [{low}, {high}] with "
                             f"step {self.step}; drop log or the step")
        return self

    def grid_values(self) -> list[int]:
        """Every value of the range, low to high by `step`."""
        low, high = self.int_
        return list(range(low, high + 1, self.step))


class Choice(_Frozen):
    choice: tuple[Any, ...]
    """The values to choose from, each once (numbers, strings, booleans, null, or lists and mappings of those)"""

    @model_validator(mode="after")
    def _distinct(self) -> Choice:
        if not self.choice:
            raise ValueError("needs at least one value, e.g. {choice: [[64], [128, 64]]}")
        try:
            keys = self.choice_keys()
        except TypeError as error:
            raise ValueError(f"each choice must be a YAML value (number, string, bool, null or a list or mapping of "
                             f"those): {error}") from None
        repeated = sorted({str(k) for k in keys if keys.count(k) > 1})
        if repeated:
            raise ValueError(f"lists {', '.join(repeated)} more than once; list each choice once")
        return self

    def choice_keys(self) -> list[Any]:
        """The choices as Optuna records categorical values (`choice_key`), in order."""
        return [choice_key(v) for v in self.choice]


def choice_key(value: Any) -> Any:
    """How a choice is recorded in the study: None, a bool, int, float or str as it is, anything else (a list, a
    mapping) as its JSON text, since Optuna's categorical values are only those kinds."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return json.dumps(value, sort_keys=True)


_KINDS = {"loguniform": LogUniform, "uniform": Uniform, "int": IntRange, "choice": Choice}


def _kind(value: Any) -> str | None:
    if isinstance(value, dict):
        found = [key for key in _KINDS if key in value]
        return found[0] if len(found) == 1 else None
    return next((key for key, model in _KINDS.items() if isinstance(value, model)), None)


Distribution = Annotated[
    Annotated[LogUniform, Tag("loguniform")] | Annotated[Uniform, Tag("uniform")] | Annotated[IntRange, Tag("int")]
    | Annotated[Choice, Tag("choice")],
    Discriminator(_kind, custom_error_type="distribution",
                  custom_error_message="must be one distribution: {loguniform: [lo, hi]}, {uniform: [lo, hi]}, "
                                       "{int: [lo, hi], step: n} or {choice: [v1, v2, ...]}"),
]
CONTINUOUS = (LogUniform, Uniform)


class TuneConfig(_Frozen):
    trials: int = Field(10, ge=1)  # trials that finish (complete or pruned); a failed one's budget goes to a new one
    """trials that finish (complete or pruned); a failed one's budget goes to a new one"""
    parallel: int = Field(1, ge=1)  # trials training at once, each in its own processes
    """trials training at once, each in its own processes"""
    # dotted config path -> distribution, e.g. `train.base_learning_rate: {loguniform: [1.0e-4, 1.0e-1]}`
    space: dict[str, Distribution] = Field(min_length=1)
    """dotted config path -> distribution, e.g. `train.base_learning_rate: {loguniform: [1.0e-4, 1.0e-1]}`"""
    sampler: Sampler = Sampler.TPE
    """tpe (Optuna's TPESampler), random, or grid (every combination of the choices and int ranges, each once)"""
    pruner: Pruner = Pruner.MEDIAN
    """median (a trial worse than the median of the finished trials at the same step stops), hyperband, or none"""
    # The median pruner prunes only after this many trials completed (Optuna's n_startup_trials).
    startup_trials: int = Field(2, ge=0)
    """The median pruner prunes only after this many trials completed (Optuna's n_startup_trials)."""
    # A metric of the trainer's evaluation at each checkpoint (train.CHECKPOINT_EVAL_METRICS); None: the one
    # best-checkpoint selection ranks by (the gate metric, or loss for one the trainer does not record).
    metric: str | None = None
    """A metric of the trainer's evaluation at each checkpoint (train.CHECKPOINT_EVAL_METRICS); None: the one
    best-checkpoint selection ranks by (the gate metric, or loss for one the trainer does not record)."""
    direction: Direction | None = None  # None: evaluation.gate.direction (loss, mae, rmse: always min)
    """None: evaluation.gate.direction (loss, mae, rmse: always min)"""
    seed: int | None = None  # the sampler's
    """the sampler's"""
    study: str | None = None  # None: the pipeline's `name`
    """None: the pipeline's `name`"""
    # None: a journal file <output_root>/tune/<study>/journal.log (one machine; survives crashes and parallel
    # writers). A path: a journal file there. A URL: a database (postgresql://user:${PASSWORD}@host/db,
    # sqlite:///path): for trials on several machines. A URL's password is masked in every dump.
    storage: SecretUri = None
    """None: a journal file <output_root>/tune/<study>/journal.log (one machine; survives crashes and parallel
    writers). A path: a journal file there. A URL: a database (postgresql://user:${PASSWORD}@host/db,
    sqlite:///path): for trials on several machines. A URL's password is masked in every dump."""

    def grid(self) -> dict[str, list[Any]]:
        """The grid sampler's search space: each path's choices (`choice_key`s) or int values.

        Raises:
            ConfigError: naming the path, for a continuous distribution (a grid has discrete points only).
        """
        grid: dict[str, list[Any]] = {}
        for path, distribution in self.space.items():
            if isinstance(distribution, CONTINUOUS):
                shown = json.dumps(distribution.model_dump(mode="json", by_alias=True))
                raise ConfigError(f"tune.space.{path} is {shown}, a continuous range, but tune.sampler grid tries "
                                 "discrete points only; write it as {choice: [...]} or {int: [lo, hi], step: n}, or "
                                 "use tune.sampler tpe or random")
            grid[path] = distribution.choice_keys() if isinstance(distribution, Choice) else distribution.grid_values()
        return grid

    def grid_size(self) -> int:
        """How many points the grid has (the product of each path's count)."""
        size = 1
        for values in self.grid().values():
            size *= len(values)
        return size


class TrialBinding(_Frozen):
    """`tune_trial`: where the chief of one tuning trial reports its evaluations. Set by the tuning runner
    (`tuning.runner`) in each trial's config, never by a user: the chief reports `metric` at each evaluation to
    trial `trial_number` of study `study` in `storage` and asks `pruner` whether to stop."""

    storage: SecretUri  # as tune.storage resolves it (a journal file's path or a database URL)
    """as tune.storage resolves it (a journal file's path or a database URL)"""
    study: str
    """The study the trial belongs to (set by the tuning runner, never by a user)"""
    trial_number: int = Field(ge=0)
    """The trial's number in its study"""
    metric: str  # the checkpoint metric reported, e.g. eval_accuracy
    """the checkpoint metric reported, e.g. eval_accuracy"""
    direction: Direction
    """Whether the reported metric improves up (max) or down (min)"""
    pruner: Pruner = Pruner.MEDIAN
    """The study's pruner, which the chief asks at each evaluation whether to stop"""
    startup_trials: int = Field(2, ge=0)
    """Trials that complete before the median pruner prunes (Optuna's n_startup_trials)"""
