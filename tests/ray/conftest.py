"""A real Ray cluster for the tests: a head and 2 worker nodes on 127.0.0.2 (`flows.stack.ray_cluster`, the same
`tfdag stack up --ray 3` starts), and this process connected to it as the driver.

Every node and the driver use 127.0.0.2 (Ray rewrites 127.0.0.1 and localhost to this machine's network address;
another loopback address is kept as given), and every node's IP is asserted to be on 127.0.0.0/8. The cluster
starts after moto's S3 server, so every node's workers inherit the S3 endpoint and its dummy credentials; it is
stopped once the last test of tests/ray has run, by killing its own processes (not `ray stop`, which would end every Ray cluster on
the machine).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
import time
from collections.abc import Iterator
from typing import NamedTuple

import psutil
import pytest

from tests.pipeline_lib.launch_support import REPO_ROOT
from tests.stores.conftest import s3, s3_server  # noqa: F401 - the S3 fixtures, shared with tests/stores

RAY_IP = "127.0.0.2"
WORKER_NODE = "tfdag_worker_node"  # flows.stack.ray_cluster.WORKER_NODE: every node but the head
LABELS = ("node_head", "node_1", "node_2")
# The GCS lists a node dead once this many health checks in a row failed: a raylet the tests SIGKILL refuses the
# check at once, so it is listed dead after ~4 periods (4 s, not the default's 15-30 s that every restart after a
# lost node, and every node a test removes, waited out); a live but busy raylet still has 4 × 5 s to answer.
FAST_NODE_DEATH = {"RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "4",
                   "RAY_health_check_timeout_ms": "5000"}


def _require_ray() -> None:
    try:
        import ray  # noqa: F401
    except ImportError:
        missing = "Ray is not installed (pip install 'tfdag[ray]', i.e. ray[default])"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{missing}: under CI=true a missing part fails the run")
        pytest.skip(missing)


class Actor(NamedTuple):
    actor_id: str
    name: str
    node_id: str


@dataclasses.dataclass
class RayCluster:
    """The running test cluster: its record, and which node carries which label."""

    record: object  # flows.stack.ray_cluster.RayClusterRecord
    node_of_label: dict[str, str]  # label -> node id

    @property
    def address(self) -> str:
        return self.record.address

    @property
    def dashboard_url(self) -> str:
        return self.record.dashboard_url

    def label_of_node(self, node_id: str) -> str:
        return next(label for label, node in self.node_of_label.items() if node == node_id)

    # The actors and placement groups are read from the GCS (this process is a driver of the cluster), not from the
    # dashboard's state API: that API stops answering, or answers stale, for a while after a test kills a node's
    # raylet, so a test reading it then would see no actor of a restart that did happen.
    def alive_actors(self, name_prefix: str = "tfdag-") -> list[Actor]:
        return self.actors(name_prefix, "ALIVE")

    def actors(self, name_prefix: str = "tfdag-", state_name: str | None = None) -> list[Actor]:
        """The actors named with `name_prefix` in `state_name` (None: any, the dead ones too: the GCS keeps where an
        ended actor ran)."""
        from ray._private import state

        return [Actor(actor_id, info["Name"], info["Address"]["NodeID"])
                for actor_id, info in state.actors(actor_state_name=state_name).items()
                if info["Name"].startswith(name_prefix)]

    def live_placement_groups(self, name_prefix: str = "tfdag-") -> list[str]:
        """The names of the placement groups not removed."""
        from ray.util import placement_group_table

        return [p["name"] for p in placement_group_table().values()
                if p["name"].startswith(name_prefix) and p["state"] != "REMOVED"]

    def add_node(self, label: str, resources: dict[str, float] | None = None) -> str:
        """Start one more worker node with `label` (and WORKER_NODE, and `resources`); returns its node id once it is
        alive."""
        import ray

        from flows.stack import ray_cluster

        ray_cluster.add_node(self.record, label, resources)
        # From the GCS (this process is a driver of the cluster), not the dashboard's state API, which stops
        # answering for a while after a test kills a node's raylet.
        deadline = time.monotonic() + 120
        while not (node_id := next((n["NodeID"] for n in ray.nodes() if n.get("Alive")
                                    and label in n.get("Resources", {})), None)):
            assert time.monotonic() < deadline, f"the node {label} did not join within 120 s"
            time.sleep(0.5)
        self.node_of_label[label] = node_id
        return node_id

    def remove_node(self, node_id: str, timeout_s: float = 90.0) -> None:
        """Stop a node a test added, so no later test sees it: its raylet is asked to stop (SIGTERM), the test waits
        until the GCS lists the node dead, then ends whatever of the node is left."""
        import ray

        raylet = psutil.Process(self.raylet_pid(node_id))
        family = [raylet, *raylet.children(recursive=True)]
        raylet.terminate()
        deadline = time.monotonic() + timeout_s
        while any(n["NodeID"] == node_id and n.get("Alive") for n in ray.nodes()):
            assert time.monotonic() < deadline, f"node {node_id} still alive {timeout_s:g} s after its raylet's SIGTERM"
            time.sleep(0.5)
        for proc in family:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        self.forget_node(node_id)

    @contextlib.contextmanager
    def nodes_of_their_own(self, group: str, count: int) -> Iterator[list[str]]:
        """`count` new nodes that only tasks asking for the resource `group` fit on (none spare for anyone else);
        yields their ids, a list the test may add to, and leaves the cluster as found: every node of the list
        removed, and one whose raylet the test killed listed dead by the GCS, so no later test counts it."""
        import ray

        added = [self.add_node(f"{group}_{i}", {group: 1}) for i in range(count)]
        try:
            yield added
        finally:
            for node in added:
                if node in self.node_of_label.values():
                    self.remove_node(node)
            deadline = time.monotonic() + 90
            while any(n.get("Alive") and n["NodeID"] in added for n in ray.nodes()) and time.monotonic() < deadline:
                time.sleep(0.5)

    def forget_node(self, node_id: str) -> None:
        """Drop a node a test killed: no label points at a dead node."""
        self.node_of_label = {label: node for label, node in self.node_of_label.items() if node != node_id}

    def raylet_pid(self, node_id: str) -> int:
        for proc in psutil.process_iter(["pid", "cmdline"]):
            args = proc.info["cmdline"] or [""]
            if os.path.basename(args[0]) == "raylet" and f"--node_id={node_id}" in args:
                return proc.info["pid"]
        raise LookupError(f"no raylet of node {node_id}")


# Package scope: the cluster goes when the last test of tests/ray has run (they run in one xdist group, one after
# the other), so its idle raylets, agents and dashboard do not take CPU from the rest of the session.
@pytest.fixture(scope="package")
def ray_cluster(s3_server) -> Iterator[RayCluster]:  # noqa: F811 - the imported fixture
    _require_ray()
    import ray

    from flows.stack import ray_cluster

    env = dict(os.environ)
    env.update({"PYTHONPATH": os.pathsep.join(p for p in (REPO_ROOT, env.get("PYTHONPATH", "")) if p),
                "TFDAG_CACHE_DIR": tempfile.mkdtemp(prefix="tfdag-ray-cache-"), "TF_CPP_MIN_LOG_LEVEL": "2"})
    env.update(FAST_NODE_DEATH)
    record = ray_cluster.start_ray_cluster(len(LABELS), env=env)
    try:
        nodes = ray_cluster.wait_for_nodes(record, len(LABELS))  # asserts every node is on 127.0.0.0/8
        assert {n["node_ip"] for n in nodes} == {RAY_IP}
        labels = {label: n["node_id"] for n in nodes for label in LABELS if label in n["resources_total"]}
        assert sorted(labels) == sorted(LABELS)
        ray.init(address=record.address, _node_ip_address=RAY_IP, log_to_driver=False, configure_logging=False)
        yield RayCluster(record=record, node_of_label=labels)
    finally:
        if ray.is_initialized():
            ray.shutdown()
        ray_cluster.stop_ray_cluster(record)

