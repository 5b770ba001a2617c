"""Peers for the preflight tests: free loopback ports, fake peers' fingerprint files and listeners."""

from __future__ import annotations

import json
import os
import socket

from pipeline_lib.cluster.fingerprint import collect_fingerprint
from pipeline_lib.cluster.info import ClusterInfo
from pipeline_lib.core.net import free_ports


def two_workers() -> list[ClusterInfo]:
    addresses = tuple(f"127.0.0.1:{port}" for port in free_ports(2))
    return [ClusterInfo(task_type="worker", task_index=i, cluster={"worker": addresses}) for i in range(2)]


def fake_peer(run_dir: str, cluster: ClusterInfo, reached: bool = True, **updates) -> None:
    fingerprint = collect_fingerprint(cluster, "c", "d", environ={}).model_copy(update={"host": "peer-host",
                                                                                        **updates})
    folder = os.path.join(run_dir, "preflight")
    os.makedirs(folder, exist_ok=True)
    slot = f"{cluster.task_type}-{cluster.task_index}"
    with open(os.path.join(folder, f"{slot}.json"), "w") as handle:
        handle.write(fingerprint.model_dump_json())
    if reached:
        with open(os.path.join(folder, f"reached-{slot}.json"), "w") as handle:
            json.dump({"task": cluster.name}, handle)


def listen_on(cluster: ClusterInfo) -> socket.socket:
    port = int(cluster.cluster[cluster.task_type][cluster.task_index].rsplit(":", 1)[1])
    return socket.create_server(("127.0.0.1", port))
