"""No secret is ever stored, on the Ray launcher: the canary run of tests/flows/test_secret_canary.py with
`train.launcher: ray` on the test cluster's nodes, its session files (every node's logs) searched as well."""

from __future__ import annotations

import pytest

from tests.canary import Canary
from tests.flows.test_secret_canary import canary_config, run_and_search
from tests.ray.conftest import RAY_IP
from tests.stores.conftest import s3, s3_server  # noqa: F401 - the S3 fixtures


@pytest.mark.slow
def test_no_output_of_a_ray_run_holds_the_canary(s3, ray_cluster, tfdag_stack, prefect_api, tmp_path,  # noqa: F811
                                                 monkeypatch, caplog):
    canary = Canary()
    values = canary_config(canary, tfdag_stack.state.mlflow_url, f"canary-ray-{tmp_path.name}", launcher="ray",
                           ray={"address": ray_cluster.address, "node_ip_address": RAY_IP})
    run_and_search(canary, values, s3, tfdag_stack, tmp_path, monkeypatch, caplog,
                   extra_dirs={"the Ray cluster's session files": ray_cluster.record.temp_dir})
    assert ray_cluster.alive_actors() == [] and ray_cluster.live_placement_groups() == []
