"""A search space against the config it tunes: `apply` (sampled values set by their dotted paths, the config
validated again) and the checks `PipelineConfig` runs when it has a `tune` section (`check_tune`): every path exists,
every end of every range and every choice validates, and every trial can run and measure the tuned metric."""

from __future__ import annotations

import json
import typing
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ValidationError

from pipeline_lib.config.base import ConfigError
from pipeline_lib.config.train import CHECKPOINT_EVAL_METRICS, Isolation
from pipeline_lib.config.tune import (
    Choice,
    IntRange,
    LogUniform,
    Sampler,
    TrialBinding,
    TuneConfig,
    Uniform,
    choice_key,
)
from pipeline_lib.core import storage
from pipeline_lib.core.secrets import secrets_context

# The config these functions take, not imported: config.pipeline imports this module (its validator calls
# check_tune), so an import back would close a circle.
PipelineConfig = Any

# Top-level keys a search may not change, and why.
FIXED_KEYS = {
    "name": "the study and its trials are named after it",
    "output_root": "the study's journal and every trial's directory are under it",
    "data": "the data is converted once per study, before the trials",
    "tune": "a search cannot tune itself",
    "tune_trial": "the tuning runner sets it in each trial's config",
}


def apply(config: PipelineConfig, params: Mapping[str, Any], *, tune_trial: TrialBinding | None = None
          ) -> PipelineConfig:
    """`config` with each value of `params` set at its dotted path (`train.base_learning_rate`,
    `model.params.hidden_units`), validated again as a whole PipelineConfig.

    Built from the config's own values (`PipelineConfig.revealed`), so a literal secret stays a secret, not a mask.
    With `tune_trial`, the result is that trial's config: `tune` dropped (the search is over for it) and the binding
    set.

    Raises:
        ConfigError: naming each path and value and the schema's complaint, when the result does not validate.
    """
    values = config.revealed()
    for path, value in params.items():
        _set(values, path, value)
    if tune_trial is not None:
        values.pop("tune", None)
        values["tune_trial"] = tune_trial.model_dump(mode="json", context=secrets_context(reveal=True))
    try:
        return type(config).model_validate(values)
    except ValidationError as error:
        shown = ", ".join(f"{path} = {_shown(value)}" for path, value in params.items())
        raise ConfigError(f"the values {shown} make an invalid config: {complaints(error)}") from None


def check_space(config: PipelineConfig) -> None:
    """Check `config.tune.space` against the config: each path is a key of the schema (or lies under a free-form
    mapping such as `model.params`) that a search may change, and the config validates, and can run as a trial,
    with each distribution's low and high end and with every choice.

    Raises:
        ConfigError: naming `tune.space.<path>`, the value and the schema's complaint.
    """
    tune = tune_of(config)
    base = config.revealed()
    base.pop("tune")
    for path, distribution in tune.space.items():
        where = f"tune.space.{path}"
        problem = _path_problem(type(config), path)
        if problem is not None:
            raise ConfigError(f"{where}: {problem}")
        for value in _ends(distribution):
            values = json.loads(json.dumps(base))  # a deep copy of JSON values
            _set(values, path, value)
            try:
                trial = type(config).model_validate(values)
            except ValidationError as error:
                raise ConfigError(f"{where} can take {_shown(value)}, which the config refuses: "
                                  f"{complaints(error)}; narrow the range or drop that choice") from None
            problem = trial_problem(tune, trial)
            if problem is not None:
                raise ConfigError(f"{where} can take {_shown(value)}, with which {problem}")


def check_tune(config: PipelineConfig) -> None:
    """The rules of a config with a `tune` section (PipelineConfig's validator calls this): the space
    (`check_space`), the grid, trials that run in their own processes and measure the tuned metric, ports that
    parallel trials do not share, and a default journal that can be written.

    Raises:
        ConfigError: naming the key, the value and the fix.
    """
    tune = config.tune
    if tune is None:
        if config.tune_trial is not None and config.train.isolation == Isolation.NONE:
            raise ConfigError("tune_trial is set (a tuning trial's config) with train.isolation 'none'; a trial "
                              "trains in its own processes: set train.isolation: process")
        return
    if config.tune_trial is not None:
        raise ConfigError("tune_trial is set beside tune; the tuning runner sets tune_trial in each trial's config, "
                          "which has no tune section: remove tune_trial")
    if tune.sampler == Sampler.GRID:
        tune.grid()  # a continuous distribution is a ConfigError naming its path
    problem = trial_problem(tune, config)
    if problem is not None:
        raise ConfigError(problem)
    observability = config.observability
    fixed = [(key, port, fix) for key, port, fix in (
        ("observability.prometheus_port", observability.prometheus_port, "set it to 0 (a free port each)"),
        ("observability.profiler_port", observability.profiler_port, "leave it out")) if port]
    if tune.parallel > 1 and fixed:
        key, port, fix = fixed[0]
        raise ConfigError(f"{key} ({port}) gives every trial's tasks the same port, and tune.parallel "
                          f"({tune.parallel}) trials train at once; {fix}, or set tune.parallel: 1")
    if tune.storage is None and not storage.is_local(config.output_root):
        raise ConfigError(f"tune.storage is left out, so the study would keep its journal file under output_root "
                          f"({config.output_root}), which is not a local directory; set tune.storage to a database "
                          "URL (postgresql://user:${PASSWORD}@host/db) or a local file path")
    check_space(config)


def trial_problem(tune: TuneConfig, trial: PipelineConfig) -> str | None:
    """Why `trial` cannot run as a trial of `tune` (in words, naming the keys), None when it can."""
    if trial.train.isolation == Isolation.NONE:
        return ("train.isolation is 'none', but every trial trains in its own processes (no memory carried from one "
                "trial to the next); set train.isolation: process")
    computed = CHECKPOINT_EVAL_METRICS[trial.model.task]
    if tune.metric is not None and tune.metric.removeprefix("eval_") not in computed:
        return (f"tune.metric ({tune.metric!r}) is not computed by the trainer's evaluation at each checkpoint for "
                f"model.task {trial.model.task.value}; set it to one of {list(computed)}, or leave it out for the "
                "gate metric")
    return None


def complaints(error: ValidationError) -> str:
    """The schema's complaints in one line: `train.per_replica_batch_size: Input should be greater than ...`."""
    parts = []
    for item in error.errors():
        loc = ".".join(str(p) for p in item["loc"] if not str(p).startswith("function-"))
        message = item["msg"].removeprefix("Value error, ")
        parts.append(f"{loc}: {message}" if loc else message)
    return "; ".join(parts)


def tune_of(config: PipelineConfig) -> TuneConfig:
    """`config.tune`.

    Raises:
        ConfigError: when the config has no tune section, naming the pipeline and the two ways on.
    """
    if config.tune is None:
        raise ConfigError(f"pipeline {config.name!r} has no tune: section, so there is nothing to tune; add one "
                          "(tune.space at least: see the README's 'Tuning hyperparameters'), or run it with "
                          "`tfdag run`")
    return config.tune


def _ends(distribution: Any) -> list[Any]:
    """The values that bound a distribution: the low and high end of a range, every choice."""
    if isinstance(distribution, Choice):
        return list(distribution.choice)
    if isinstance(distribution, IntRange):
        return list(distribution.int_)
    if isinstance(distribution, LogUniform):
        return list(distribution.loguniform)
    if isinstance(distribution, Uniform):
        return list(distribution.uniform)
    raise TypeError(f"unknown distribution {distribution!r}")


def _path_problem(model: type[BaseModel], path: str) -> str | None:
    """Why `path` names no key a search may set (in words), None when it does."""
    parts = path.split(".")
    if parts[0] in FIXED_KEYS:
        return f"{parts[0]} cannot be tuned: {FIXED_KEYS[parts[0]]}"
    current: type[BaseModel] = model
    for depth, part in enumerate(parts):
        fields = {(field.alias or name): field for name, field in current.model_fields.items()}
        here = ".".join(parts[:depth + 1])
        field = fields.get(part)
        if field is None:
            section = ".".join(parts[:depth]) or "the top level"
            return f"{here} is not a known key; allowed keys in {section}: {', '.join(sorted(fields))}"
        if depth == len(parts) - 1:
            return None
        candidates = [field.annotation, *typing.get_args(field.annotation)]
        section_model = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if section_model is not None:
            current = section_model
            continue
        if any(c is dict or typing.get_origin(c) is dict for c in candidates):
            return None  # a free-form mapping (model.params): any key below it
        return f"{here} is a value, not a section, so {path} names nothing; tune {here} itself"
    return None


_MISSING = object()


def value_at(config: PipelineConfig, path: str) -> Any:
    """The value at a dotted path of `config` as YAML writes it (`model.params.hidden_units` → `[128, 64]`); None
    when the path is not set (a free-form key the config leaves out)."""
    value: Any = config.model_dump(mode="json", by_alias=True)
    for part in path.split("."):
        value = value.get(part, _MISSING) if isinstance(value, dict) else _MISSING
        if value is _MISSING:
            return None
    return value


def config_point(config: PipelineConfig, space: Mapping[str, Any]) -> dict[str, Any]:
    """The config's own values as a point of `space`, in Optuna's terms (a choice by its `choice_key`): for each path
    whose value the space can sample (in its range, on its step, among its choices); other paths are left out."""
    point: dict[str, Any] = {}
    for path, distribution in space.items():
        value = value_at(config, path)
        if value is None or isinstance(value, bool):
            continue
        if isinstance(distribution, Choice):
            if choice_key(value) in distribution.choice_keys():
                point[path] = choice_key(value)
        elif isinstance(distribution, IntRange):
            if isinstance(value, int) and value in distribution.grid_values():
                point[path] = value
        elif isinstance(value, (int, float)):
            low, high = distribution.loguniform if isinstance(distribution, LogUniform) else distribution.uniform
            if low <= value <= high:
                point[path] = float(value)
    return point


def _set(values: dict[str, Any], path: str, value: Any) -> None:
    """Set `value` at the dotted `path` of nested mappings, making the mappings missing on the way."""
    *parents, leaf = path.split(".")
    current = values
    for part in parents:
        if not isinstance(current.get(part), dict):
            current[part] = {}
        current = current[part]
    current[leaf] = value


def _shown(value: Any) -> str:
    return json.dumps(value) if not isinstance(value, str) else repr(value)
