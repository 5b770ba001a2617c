"""A local Ray cluster of N nodes on 127.0.0.2, for `tfdag stack up --ray N` and the Ray tests.

A head and N−1 worker raylets, started with `ray start`, each its own node with one CPU and its own resource label
(`node_head`, `node_1`, ...; worker nodes also carry `tfdag_worker_node`). Every node and the driver use 127.0.0.2:
Ray rewrites 127.0.0.1 and localhost given as a node IP to this machine's network address, while another loopback
address is kept as given, so no Ray traffic leaves loopback. The cluster has its own temp dir and ports, and is
stopped by killing exactly its own processes (found by that temp dir or its GCS address, with their children) —
never `ray stop`, which ends every Ray cluster on the machine.
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import tempfile
import time
from collections.abc import Mapping

import psutil
from pydantic import BaseModel, ConfigDict

from flows.stack.processes import StackError, console_script, end_processes, run_command
from pipeline_lib.core.net import free_ports

RAY_HOST = "127.0.0.2"
WORKER_NODE = "tfdag_worker_node"  # on every node but the head


class RayClusterError(StackError):
    """The local Ray cluster could not start; the message has `ray start`'s output."""


class RayClusterRecord(BaseModel):
    """What was started: enough to reach the cluster and to stop exactly its processes."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    address: str  # the GCS address: train.ray.address / RAY_ADDRESS
    dashboard_url: str  # the dashboard and Ray's state API
    temp_dir: str
    num_nodes: int
    env: dict[str, str] = {}
    node_args: tuple[str, ...] = ()

    def node_label(self, index: int) -> str:
        return "node_head" if index == 0 else f"node_{index}"


def _ray_start(args: list[str], env: Mapping[str, str]) -> None:
    run_command([console_script("ray"), "start", *args], env=env, timeout_s=180, error=RayClusterError)


def add_node(record: RayClusterRecord, label: str, resources: Mapping[str, float] | None = None) -> None:
    """Start one more worker node with resource `label` (and WORKER_NODE, and `resources`)."""
    agent_port = free_ports(1, RAY_HOST)[0]
    offered = {label: 1, WORKER_NODE: 1, **(resources or {})}
    _ray_start(["--address", record.address, "--dashboard-agent-listen-port", str(agent_port),
                "--resources", json.dumps(offered), *record.node_args], record.env)


def start_ray_cluster(num_nodes: int, *, env: Mapping[str, str] | None = None, num_cpus: int = 1,
                      timeout_s: float = 120.0) -> RayClusterRecord:
    """Start a head and `num_nodes - 1` worker nodes on 127.0.0.2 and wait until every node is alive.

    Args:
        num_nodes: nodes in all (≥ 1).
        env: the environment of the nodes (their workers inherit it: storage credentials, PYTHONPATH).
        num_cpus: CPUs each node offers.

    Raises:
        RayClusterError: a `ray start` failed or the nodes did not all join; what started is stopped again.
    """
    if num_nodes < 1:
        raise RayClusterError(f"--ray {num_nodes}: a Ray cluster needs at least 1 node (the head)")
    temp_dir = tempfile.mkdtemp(prefix="tfdag-ray-")  # short: Ray's socket paths must fit in 107 characters
    gcs_port, dashboard_port, client_port, agent_port = free_ports(4, RAY_HOST)
    node_env = dict(os.environ if env is None else env)
    node_env["RAY_USAGE_STATS_ENABLED"] = "0"
    node_env.pop("RAY_ADDRESS", None)
    # One authentication mode for every node: left unset, `ray start --head` turns token auth on when
    # ~/.ray/auth_token exists (a local `ray.init()` writes one) while `ray start --address` stays off, and every
    # node is then refused by the head ("InvalidAuthToken"). The cluster is on loopback only; RAY_AUTH_MODE=token
    # in the environment is kept.
    node_env.setdefault("RAY_AUTH_MODE", "disabled")
    node_args = ("--node-ip-address", RAY_HOST, "--num-cpus", str(num_cpus), "--object-store-memory",
                 str(80 * 2**20), "--temp-dir", temp_dir, "--disable-usage-stats")
    record = RayClusterRecord(address=f"{RAY_HOST}:{gcs_port}", dashboard_url=f"http://{RAY_HOST}:{dashboard_port}",
                              temp_dir=temp_dir, num_nodes=num_nodes, env=node_env, node_args=node_args)
    try:
        _ray_start(["--head", "--port", str(gcs_port), "--include-dashboard", "true", "--dashboard-host", RAY_HOST,
                    "--dashboard-port", str(dashboard_port), "--ray-client-server-port", str(client_port),
                    "--dashboard-agent-listen-port", str(agent_port), "--resources", '{"node_head": 1}',
                    *node_args], node_env)
        for index in range(1, num_nodes):
            add_node(record, record.node_label(index))
        wait_for_nodes(record, num_nodes, timeout_s)
    except BaseException:
        stop_ray_cluster(record)
        raise
    return record


def live_nodes(record: RayClusterRecord) -> list[dict]:
    """The cluster's alive nodes, from its state API (no driver connection needed)."""
    from ray.util.state import list_nodes

    return [n.__dict__ if hasattr(n, "__dict__") else n
            for n in list_nodes(address=record.dashboard_url, filters=[("state", "=", "ALIVE")], limit=1000)]


def wait_for_nodes(record: RayClusterRecord, count: int, timeout_s: float = 120.0) -> list[dict]:
    """Wait until `count` nodes are alive, each on a loopback address.

    Raises:
        RayClusterError: they did not join in time, or a node is not on 127.0.0.0/8.
    """
    deadline = time.monotonic() + timeout_s
    nodes: list[dict] = []
    while time.monotonic() < deadline:
        try:
            nodes = live_nodes(record)
        except Exception:  # noqa: BLE001 - the state API is still starting
            nodes = []
        if len(nodes) >= count:
            break
        time.sleep(1.0)
    else:
        raise RayClusterError(f"only {len(nodes)} of {count} Ray node(s) joined within {timeout_s:g} s; see the "
                              f"logs under {record.temp_dir}/session_latest/logs")
    for node in nodes:
        if ipaddress.ip_address(node["node_ip"]) not in ipaddress.ip_network("127.0.0.0/8"):
            raise RayClusterError(f"Ray node {node['node_id']} is on {node['node_ip']}, not on loopback")
    return nodes


def stop_ray_cluster(record: RayClusterRecord, timeout_s: float = 10.0) -> str:
    """Kill this cluster's processes and their children, by pid; returns what was done."""
    me = os.getpid()
    found: dict[int, psutil.Process] = {}
    # Found by command line, not by a recorded pid: `ray start` daemonizes its raylets and GCS.
    for proc in psutil.process_iter(["pid", "cmdline"]):
        args = proc.info["cmdline"] or []
        if proc.pid != me and any(record.temp_dir in a or record.address in a for a in args):
            found[proc.pid] = proc
    for proc in list(found.values()):
        try:
            for child in proc.children(recursive=True):
                if child.pid != me:
                    found.setdefault(child.pid, child)
        except psutil.Error:
            pass
    end_processes(found.values(), timeout_s, graceful=False)
    shutil.rmtree(record.temp_dir, ignore_errors=True)
    return f"ray cluster {record.address}: stopped {len(found)} process(es)"
