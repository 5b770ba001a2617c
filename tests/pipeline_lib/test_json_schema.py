"""The config's JSON Schema (`tfdag schema`, pipeline_lib/config/tfdag-config.schema.json): fresh, the same as the
models, and named by every example config, each of which it validates."""

from __future__ import annotations

import glob
import os
from pathlib import Path

import jsonschema
import pytest
import yaml

from flows.cli import main
from pipeline_lib.config import load_config
from pipeline_lib.config.json_schema import SCHEMA_PATH, config_schema, schema_text

PROJECT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = sorted(glob.glob(os.path.join(PROJECT, "examples", "*.yaml")))


def test_the_committed_schema_is_the_models_and_tfdag_schema_prints_it(capsys):
    assert SCHEMA_PATH.read_text() == schema_text(), (
        "pipeline_lib/config/tfdag-config.schema.json is stale: regenerate it with "
        "`tfdag schema > pipeline_lib/config/tfdag-config.schema.json`")
    assert main(["schema"]) == 0
    assert capsys.readouterr().out == SCHEMA_PATH.read_text()


@pytest.mark.parametrize("path", EXAMPLES, ids=os.path.basename)
def test_every_example_names_the_schema_and_validates_against_it(path):
    text = Path(path).read_text()
    first = text.splitlines()[0].strip()
    assert first.startswith("# yaml-language-server: $schema="), first
    reference = first.split("$schema=", 1)[1]
    assert os.path.samefile(os.path.join(os.path.dirname(path), reference), SCHEMA_PATH)
    jsonschema.Draft202012Validator(config_schema()).validate(yaml.safe_load(text))
    load_config(path)  # and the models take it


def test_the_schema_refuses_what_the_models_refuse():
    validator = jsonschema.Draft202012Validator(config_schema())
    good = {"name": "x", "data": {"source": "rows.csv", "label": "y"}}
    validator.validate(good)
    for bad in ({**good, "data": {"sourc": "rows.csv", "label": "y"}},
                {**good, "train": {"steps": "many"}},
                {**good, "data": {**good["data"], "engine": "spark"}}):
        assert list(validator.iter_errors(bad)), bad


def test_every_key_has_a_description_for_the_schema_and_the_reference():
    """What editors show beside a key, Prefect's deployment form shows beside a parameter, and the reference lists."""
    missing: list[str] = []

    def walk(schema: dict, where: str) -> None:
        if "$ref" in schema:
            schema = definitions[schema["$ref"].rsplit("/", 1)[1]]
        for name, field in schema.get("properties", {}).items():
            if not field.get("description"):
                missing.append(f"{where}{name}")
            for branch in [field, *field.get("anyOf", []), field.get("additionalProperties") or {}]:
                if isinstance(branch, dict) and "$ref" in branch and f"{where}{name}." not in seen:
                    seen.add(f"{where}{name}.")
                    walk(branch, f"{where}{name}.")

    schema = config_schema()
    definitions, seen = schema["$defs"], set()
    walk(schema, "")
    missing += [f"{model}.{name}" for model, definition in definitions.items()  # the models in unions too
                for name, field in definition.get("properties", {}).items() if not field.get("description")]
    assert len(seen) > 10 and missing == [], missing
