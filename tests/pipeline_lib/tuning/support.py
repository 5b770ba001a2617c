"""Helpers of the tuning tests: a small pipeline config with a `tune` section."""

from __future__ import annotations

from typing import Any

from pipeline_lib.config import PipelineConfig, parse_config

SPACE = {"train.base_learning_rate": {"loguniform": [1.0e-4, 1.0e-1]}}


def tune_config(root: str, *, task: str = "classification", train: dict[str, Any] | None = None,
                model: dict[str, Any] | None = None, source: str = "<test>", **tune: Any) -> PipelineConfig:
    """A config with `tune` (default: 3 trials over the learning rate) whose output_root is `root`."""
    return parse_config({
        "name": "tune-test",
        "data": {"source": "unused.csv", "label": "label"},
        "output_root": root,
        "model": model or {"factory": "mlp", "task": task, "params": {"hidden_units": [8]}},
        "train": train or {},
        "preflight": {"enabled": False},
        "tracking": {"enabled": False},
        "tune": {"trials": 3, "space": SPACE, **tune},
    }, source)
