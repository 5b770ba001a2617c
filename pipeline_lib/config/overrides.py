"""A config with dotted keys replaced (the retrain flow's `overrides`, its warm start), validated again."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pipeline_lib.config.base import ConfigError
from pipeline_lib.config.pipeline import PipelineConfig, parse_config


def apply_overrides(config: PipelineConfig, overrides: Mapping[str, Any], source: str = "overrides") -> PipelineConfig:
    """A copy of the config with dotted-key values replaced, validated again.

    Example: `{"train.steps": 1, "evaluation.gate.threshold": None}`.

    Raises:
        ConfigError: naming the key when it does not exist or its value is invalid.
    """
    data = config.revealed()  # re-validated in this process: a literal secret must stay usable
    for dotted, value in overrides.items():
        parts = dotted.split(".")
        node = data
        for i, part in enumerate(parts[:-1]):
            child = node.get(part) if isinstance(node, dict) else None
            if not isinstance(child, dict):
                raise ConfigError(
                    f"{source} key {dotted!r}: {'.'.join(parts[:i + 1])} is not a config section; "
                    "use dotted keys of the pipeline YAML such as train.steps or evaluation.gate.threshold"
                )
            node = child
        node[parts[-1]] = value
    return parse_config(data, source=source)
