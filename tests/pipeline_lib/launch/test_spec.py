"""The WorkerSpec a launcher hands each worker: a frozen JSON round trip whose config is validated."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from pipeline_lib.config import parse_config
from pipeline_lib.launch.spec import load_spec
from tests.pipeline_lib.launch_support import (
    make_config,
    make_spec,
    plan_for,
    write_dataset_on_disk,
)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return write_dataset_on_disk(str(tmp_path_factory.mktemp("spec_data")), num_train=256, num_eval=64)


def test_spec_round_trips_through_json(tmp_path, dataset):
    config = make_config(str(tmp_path))
    spec = make_spec(config, dataset, plan_for(dataset, config, steps=4), str(tmp_path / "run"))
    path = tmp_path / "spec.json"
    path.write_text(spec.model_dump_json())
    loaded = load_spec(str(path))
    assert loaded == spec
    assert loaded.pipeline_config() == config
    with pytest.raises(ValidationError, match="frozen"):
        spec.run_dir = "elsewhere"

def test_config_in_spec_is_validated(tmp_path, dataset):
    config = make_config(str(tmp_path))
    spec = make_spec(config, dataset, plan_for(dataset, config, steps=4), str(tmp_path / "run"))
    bad = spec.model_copy(update={"config": {**spec.config, "train": {"workers": 0}}})
    with pytest.raises(ValueError, match="train.workers"):
        bad.pipeline_config()
    assert parse_config(spec.config) == config
