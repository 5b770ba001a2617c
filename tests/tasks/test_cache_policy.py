"""No task caches its result: a resumed run skips finished stages by its stage record (digests), not by Prefect's
cache key (the flow run and the task's source), which misses on a retried flow run and after a fix."""

from __future__ import annotations

import importlib
import pkgutil

from prefect import Task
from prefect.cache_policies import NO_CACHE

import tasks


def test_every_task_sets_no_cache():
    found = {}
    for module in pkgutil.iter_modules(tasks.__path__):
        loaded = importlib.import_module(f"tasks.{module.name}")
        found.update({f"{module.name}.{name}": value for name, value in vars(loaded).items()
                      if isinstance(value, Task) and value.__module__ == loaded.__name__})
    assert {"stages.train", "stages.track", "retrain.evaluate_champion", "tune.run_trials"} <= set(found)
    cached = sorted(name for name, value in found.items() if value.cache_policy is not NO_CACHE)
    assert not cached, f"tasks with Prefect's result cache: {cached}"
