"""Tests for pipeline_lib.testing.worker_support: what the worker entry adds to a task from a test's variables."""

from __future__ import annotations

import pytest

from pipeline_lib.cluster.info import ClusterInfo
from pipeline_lib.launch import worker
from pipeline_lib.testing import worker_support
from pipeline_lib.testing.example_ids import EXAMPLE_IDS_ENV, ExampleIdRecorder
from pipeline_lib.testing.faults import FAULT_ENV, FaultHooks, FaultInjected
from pipeline_lib.testing.preflight_override import OVERRIDE_ENV
from tests.pipeline_lib.launch_support import (
    make_config,
    make_spec,
    plan_for,
    write_digits_dataset,
)


def test_the_entry_asks_for_test_support_by_the_variables_it_reads():
    assert set(worker.TEST_SUPPORT_VARIABLES) == set(worker_support.VARIABLES)


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    return write_digits_dataset(str(tmp_path_factory.mktemp("digits")), example_ids=True)


def test_a_trainer_gets_its_faults_and_records_and_a_server_only_the_skew(tmp_path, digits):
    config = make_config(str(tmp_path), label="target", strategy="parameter_server", workers=2, parameter_servers=1)
    spec = make_spec(config, digits, plan_for(digits, config, steps=4), str(tmp_path / "run"))
    cluster = {"chief": ("h:1",), "worker": ("h:2", "h:3"), "ps": ("h:4",)}
    environ = {FAULT_ENV: "raise:worker=0:step=3", EXAMPLE_IDS_ENV: str(tmp_path / "ids"),
               OVERRIDE_ENV: '{"numpy": "1.0"}'}
    chief = worker_support.additions_from_env(spec, config, ClusterInfo(task_type="chief", cluster=cluster), digits,
                                              environ)
    assert [type(hook) for hook in chief.hooks] == [FaultHooks, ExampleIdRecorder]
    assert chief.hooks[1].num_workers == 2  # the `worker` job trains under parameter_server
    with pytest.raises(FaultInjected, match="raise:worker=0:step=3"):
        chief.hooks[0].on_step_end(3, 32, 0.5)
    assert chief.fingerprint_fn is not None and len(chief.before_result) == 1
    server = worker_support.additions_from_env(spec, config, ClusterInfo(task_type="ps", cluster=cluster), digits,
                                               environ)
    assert server.hooks == () and server.before_result == () and server.fingerprint_fn is not None
    assert worker_support.additions_from_env(spec, config, ClusterInfo(task_type="chief", cluster=cluster), digits,
                                             {}) == worker.NO_ADDITIONS
