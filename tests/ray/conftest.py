"""A real Ray cluster for the tests: a head and 2 worker nodes started with `ray start` on 127.0.0.2.

Every node and the driver use 127.0.0.2 (Ray rewrites 127.0.0.1 and localhost to this machine's network address;
another loopback address is kept as given), so no Ray traffic leaves loopback. Each node has its own resource
label (`node_head`, `node_1`, `node_2`) and one CPU. The cluster gets its own temp dir and ports, and is ended at
the session's end by killing its own processes (found by that temp dir and its GCS address), not `ray stop`,
which would end every Ray cluster on the machine. It starts after moto's S3 server, so every node's workers
inherit the S3 endpoint and its dummy credentials.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import psutil
import pytest

from pipeline_lib.core.net import free_ports
from tests.pipeline_lib.launch_support import REPO_ROOT
from tests.s3.conftest import s3, s3_server  # noqa: F401 - the S3 fixtures, shared with tests/s3

RAY_IP = "127.0.0.2"
LABELS = ("node_head", "node_1", "node_2")
WORKER_NODE = "tfdag_worker_node"  # every node but the head: a test that kills a node never kills the head


def _require_ray() -> None:
    try:
        import ray  # noqa: F401
    except ImportError:
        missing = "Ray is not installed (pip install 'tfdag[ray]', i.e. ray[default])"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{missing}: under CI=true a missing part fails the run")
        pytest.skip(missing)


@dataclasses.dataclass
class RayCluster:
    """The running test cluster: its address, state API URL, and which node carries which label."""

    address: str
    dashboard_url: str
    temp_dir: str
    node_of_label: dict[str, str]  # label -> node id
    env: dict[str, str]
    common_args: list[str]

    def label_of_node(self, node_id: str) -> str:
        return next(label for label, node in self.node_of_label.items() if node == node_id)

    def alive_actors(self, name_prefix: str = "tfdag-") -> list:
        from ray.util.state import list_actors

        return [a for a in list_actors(address=self.dashboard_url, filters=[("state", "=", "ALIVE")], limit=1000)
                if (a.name or "").startswith(name_prefix)]

    def live_placement_groups(self, name_prefix: str = "tfdag-") -> list:
        from ray.util.state import list_placement_groups

        return [p for p in list_placement_groups(address=self.dashboard_url, limit=1000)
                if p.name.startswith(name_prefix) and p.state != "REMOVED"]

    def add_node(self, label: str) -> str:
        """Start one more worker node with `label` (and WORKER_NODE); returns its node id once it is alive."""
        import ray

        _ray_start(["--address", self.address, "--dashboard-agent-listen-port", str(free_ports(1, RAY_IP)[0]),
                    "--resources", f'{{"{label}": 1, "{WORKER_NODE}": 1}}', *self.common_args], self.env)
        deadline = time.monotonic() + 60
        while True:
            found = [n["NodeID"] for n in ray.nodes() if n["Alive"] and label in n["Resources"]]
            if found:
                self.node_of_label[label] = found[0]
                return found[0]
            assert time.monotonic() < deadline, f"node {label} did not join"
            time.sleep(0.5)

    def raylet_pid(self, node_id: str) -> int:
        for proc in psutil.process_iter(["pid", "cmdline"]):
            if any(f"--node_id={node_id}" == arg for arg in proc.info["cmdline"] or []) and "raylet" in \
                    os.path.basename((proc.info["cmdline"] or [""])[0]):
                return proc.info["pid"]
        raise LookupError(f"no raylet of node {node_id}")


def _ray_start(args: list[str], env: dict[str, str]) -> None:
    command = [os.path.join(os.path.dirname(sys.executable), "ray"), "start", *args]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")


def _stop(temp_dir: str, gcs_address: str) -> None:
    """Kill this cluster's processes (and their children) by pid: matched by its temp dir or its GCS address."""
    me = os.getpid()
    found: dict[int, psutil.Process] = {}
    for proc in psutil.process_iter(["pid", "cmdline"]):
        args = proc.info["cmdline"] or []
        if proc.pid != me and any(temp_dir in a or gcs_address in a for a in args):
            found[proc.pid] = proc
    for proc in list(found.values()):
        try:
            for child in proc.children(recursive=True):
                found.setdefault(child.pid, child)
        except psutil.Error:
            pass
    for proc in found.values():
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(list(found.values()), timeout=10)


@pytest.fixture(scope="session")
def ray_cluster(s3_server) -> Iterator[RayCluster]:  # noqa: F811 - the imported fixture
    _require_ray()
    import ray

    temp_dir = tempfile.mkdtemp(prefix="tfdag-ray-test-")
    gcs_port, dashboard_port, client_port, *agent_ports = free_ports(6, RAY_IP)
    address = f"{RAY_IP}:{gcs_port}"
    env = dict(os.environ)
    env.update({"PYTHONPATH": os.pathsep.join(p for p in (REPO_ROOT, env.get("PYTHONPATH", "")) if p),
                "RAY_USAGE_STATS_ENABLED": "0", "TFDAG_CACHE_DIR": os.path.join(temp_dir, "tfdag-cache"),
                "TF_CPP_MIN_LOG_LEVEL": "2"})
    env.pop("RAY_ADDRESS", None)
    common = ["--node-ip-address", RAY_IP, "--num-cpus", "1", "--object-store-memory", str(80 * 2**20),
              "--temp-dir", temp_dir, "--disable-usage-stats"]
    try:
        _ray_start(["--head", "--port", str(gcs_port), "--include-dashboard", "true", "--dashboard-host", RAY_IP,
                    "--dashboard-port", str(dashboard_port), "--ray-client-server-port", str(client_port),
                    "--dashboard-agent-listen-port", str(agent_ports[0]), "--resources", '{"node_head": 1}', *common],
                   env)
        for index, label in enumerate(LABELS[1:], start=1):
            _ray_start(["--address", address, "--dashboard-agent-listen-port", str(agent_ports[index]),
                        "--resources", f'{{"{label}": 1, "{WORKER_NODE}": 1}}', *common], env)
        ray.init(address=address, _node_ip_address=RAY_IP, log_to_driver=False, configure_logging=False)
        deadline = time.monotonic() + 60
        while len([n for n in ray.nodes() if n["Alive"]]) < len(LABELS):
            assert time.monotonic() < deadline, f"the Ray nodes did not all join: {ray.nodes()}"
            time.sleep(0.5)
        nodes = [n for n in ray.nodes() if n["Alive"]]
        for node in nodes:  # everything on loopback
            assert ipaddress.ip_address(node["NodeManagerAddress"]) in ipaddress.ip_network("127.0.0.0/8"), node
        labels = {label: n["NodeID"] for n in nodes for label in LABELS if label in n["Resources"]}
        assert sorted(labels) == sorted(LABELS)
        yield RayCluster(address=address, dashboard_url=f"http://{RAY_IP}:{dashboard_port}", temp_dir=temp_dir,
                         node_of_label=labels, env=env, common_args=common)
    finally:
        if ray.is_initialized():
            ray.shutdown()
        _stop(temp_dir, address)
        shutil.rmtree(temp_dir, ignore_errors=True)
