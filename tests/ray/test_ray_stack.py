"""`tfdag stack up --ray N` / `down`: the local Ray cluster the stack records is reachable and stopped with it."""

from __future__ import annotations

import io

import psutil

from flows import stack
from flows.stack import ray_cluster
from tests.ray.conftest import _require_ray


def _processes_of(record) -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["cmdline"])
            if any(record.temp_dir in a or record.address in a for a in p.info["cmdline"] or [])]


def test_stack_down_stops_the_recorded_ray_cluster_and_the_env_file_names_it(tmp_path):
    _require_ray()
    record = ray_cluster.start_ray_cluster(1)
    try:
        nodes = ray_cluster.wait_for_nodes(record, 1)
        assert [n["node_ip"] for n in nodes] == [ray_cluster.RAY_HOST]
        root = tmp_path / ".tfdag"
        state = stack.StackState(root=str(root), project_dir=str(tmp_path), prefect_ui_url="http://127.0.0.1:1",
                                 prefect_api_url="http://127.0.0.1:1/api", mlflow_url="http://127.0.0.1:2",
                                 work_pool=stack.WORK_POOL, services=(), ray=record)
        stack.write_state(root, state)
        assert f"export RAY_ADDRESS={record.address}" in stack.env_file_text(state)
        out = io.StringIO()
        stack.print_addresses(stack.read_state(root), out)
        assert f"Ray cluster:     {record.address} (1 nodes" in out.getvalue()
        assert _processes_of(record)
        lines = stack.stack_down(root)
        assert lines and lines[-1].startswith(f"ray cluster {record.address}: stopped")
        assert _processes_of(record) == []
    finally:
        ray_cluster.stop_ray_cluster(record)
