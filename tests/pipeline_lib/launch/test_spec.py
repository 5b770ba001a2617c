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


def test_a_literal_secret_reaches_the_workers_environment_not_the_0600_spec_file(tmp_path, dataset, monkeypatch):
    import os
    import stat

    from pipeline_lib.core import storage
    from pipeline_lib.launch.local import LocalGroup
    from pipeline_lib.launch.processes import TaskSpec, worker_env
    from pipeline_lib.launch.spec import WorkerSpec

    secret = "literal-secret-value-0042"
    config = make_config(str(tmp_path)).model_copy(update={"storage_options": {"secret": secret}})
    values, secret_env = config.for_process()
    spec = WorkerSpec(config=values, dataset_uri=dataset.dataset_uri, plan=plan_for(dataset, config, steps=4),
                      run_dir=str(tmp_path / "run"), heartbeat_dir=str(tmp_path / "heartbeats"))
    group = LocalGroup(spec, config, env=secret_env)
    try:
        assert stat.S_IMODE(os.stat(group.spec_path).st_mode) == 0o600
        with open(group.spec_path) as handle:
            written = handle.read()
        assert secret not in written and "${TFDAG_SECRET_" in written
        # What the worker process gets: the reference in its spec, the value in its environment.
        env = worker_env(TaskSpec(group.plan_attempt()[0].cluster, is_trainer=True), group.extra_env)
        worker_config = load_spec(group.spec_path).pipeline_config()
        name = worker_config.storage_options["secret"][2:-1]
        assert env[name] == secret
    finally:
        group.close()
    assert not os.path.exists(group.spec_path)
    monkeypatch.setenv(name, secret)  # the worker resolves the reference where it opens the storage
    assert storage.expand_env(worker_config.storage_options) == {"secret": secret}
