"""Tests for pipeline_lib.launch.inputs: input that cannot work fails before conversion."""

from __future__ import annotations

import pytest

from pipeline_lib.config import ConfigError, parse_config
from pipeline_lib.launch.inputs import check_inputs


def test_validation_against_the_champion_needs_a_registered_model(tmp_path):
    source = tmp_path / "rows.csv"
    source.write_text("a,y\n1.0,0\n")
    values = {"data": {"source": str(source), "label": "y"}, "output_root": str(tmp_path / "out"),
              "validation": {"against": "champion"}}
    with pytest.raises(ConfigError, match=r"validation.against is 'champion' but tracking.registered_model"):
        check_inputs(parse_config(values), environ={})
    check_inputs(parse_config({**values, "tracking": {"registered_model": "m"}}), environ={})


def test_a_model_factory_that_is_no_model_factory_fails_the_input_check(tmp_path, monkeypatch):
    from pipeline_lib.training.models import ModelFactoryError

    (tmp_path / "old_style.py").write_text("def build(schema_and_more, num_outputs):\n    return None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    values = {"data": {"source": str(tmp_path / "rows.csv"), "label": "y"}, "output_root": str(tmp_path / "out"),
              "model": {"factory": "old_style:build"}}
    with pytest.raises(ModelFactoryError, match=r"'old_style:build' cannot be called with one FactoryInputs .* "
                                                r"define it as a pipeline_lib\.training\.models\.ModelFactory"):
        check_inputs(parse_config(values), environ={})
