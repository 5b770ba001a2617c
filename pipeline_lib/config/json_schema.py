"""The config's JSON Schema: generated from the pydantic models, printed by `tfdag schema`, committed beside this
module as SCHEMA_NAME (a test keeps it fresh), and named by every example config's `yaml-language-server` line so
that editors complete and check the keys."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeline_lib.config.pipeline import PipelineConfig

SCHEMA_NAME = "tfdag-config.schema.json"
SCHEMA_PATH = Path(__file__).resolve().with_name(SCHEMA_NAME)
DIALECT = "https://json-schema.org/draft/2020-12/schema"


def config_schema() -> dict[str, Any]:
    """The JSON Schema of a pipeline YAML file (what `PipelineConfig` validates)."""
    schema = PipelineConfig.model_json_schema(mode="validation")
    return {"$schema": DIALECT, "title": "tfdag pipeline config", **{k: v for k, v in schema.items() if k != "title"}}


def schema_text() -> str:
    """`config_schema()` as the committed file holds it."""
    return json.dumps(config_schema(), indent=2, ensure_ascii=False) + "\n"


def modeline(schema_ref: str) -> str:
    """The first line of a config that points editors (the YAML language server) at the schema."""
    return f"# yaml-language-server: $schema={schema_ref}"
