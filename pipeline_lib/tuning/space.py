"""The search space on Optuna's side: `suggest` samples a trial's values, `values_of` reads a finished trial's back;
`apply` and `check_space` (the space against the config) are `config.tune_space`'s, where the config's validator
can call them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import optuna

from pipeline_lib.config import Choice, IntRange, LogUniform, Uniform
from pipeline_lib.config.tune import Distribution
from pipeline_lib.config.tune_space import apply, check_space

__all__ = ["apply", "check_space", "suggest", "values_of"]


def suggest(trial: optuna.Trial, space: Mapping[str, Distribution]) -> dict[str, Any]:
    """Sample one value per path of `space` for `trial`, as the config takes them.

    Each path is an Optuna parameter of the same name. A choice is suggested as its `choice_key` (Optuna's
    categorical values are None, bool, int, float or str) and returned as the value itself, e.g. `[128, 64]`.
    """
    values: dict[str, Any] = {}
    for path, distribution in space.items():
        if isinstance(distribution, LogUniform):
            values[path] = trial.suggest_float(path, *distribution.loguniform, log=True)
        elif isinstance(distribution, Uniform):
            values[path] = trial.suggest_float(path, *distribution.uniform)
        elif isinstance(distribution, IntRange):
            low, high = distribution.int_
            values[path] = trial.suggest_int(path, low, high, step=distribution.step, log=distribution.log)
        elif isinstance(distribution, Choice):
            keys = distribution.choice_keys()
            values[path] = distribution.choice[keys.index(trial.suggest_categorical(path, keys))]
        else:
            raise TypeError(f"tune.space.{path}: unknown distribution {distribution!r}")
    return values


def values_of(params: Mapping[str, Any], space: Mapping[str, Distribution]) -> dict[str, Any]:
    """A trial's recorded Optuna params as the config takes them: a choice's key mapped back to its value (a key
    the space no longer lists, after the space changed between runs of a study, is kept as recorded)."""
    values = dict(params)
    for path, distribution in space.items():
        if isinstance(distribution, Choice) and path in values:
            keys = distribution.choice_keys()
            if values[path] in keys:
                values[path] = distribution.choice[keys.index(values[path])]
    return values
