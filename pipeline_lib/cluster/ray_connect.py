"""Connecting this process to a Ray cluster as a driver: what training, conversion and batch scoring on Ray share.

Ray is imported only inside these functions, and only when a config asks for Ray.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Mapping
from typing import Any

from pipeline_lib.cluster.address import address_problem, split_address
from pipeline_lib.config import RayConfig
from pipeline_lib.core.errors import TfdagError, UserError

PROBE_TIMEOUT_S = 5.0
# Ray's names for resources a task or actor requests with its own arguments; the rest are custom resources.
_BUILTIN = {"CPU": "num_cpus", "GPU": "num_gpus", "memory": "memory"}


class RayClusterError(UserError, RuntimeError):
    """The Ray cluster cannot run the work as configured (address, nodes, resources): raised before any task."""


def ray_module() -> Any:
    import ray  # only work on Ray pays for the import

    return ray


def connect(ray_config: RayConfig, environ: Mapping[str, str] | None = None) -> bool:
    """Connect this process to the Ray cluster at train.ray.address (or RAY_ADDRESS) as a driver, unless it already
    is one; True when this call connected.

    Raises:
        ConfigError: neither train.ray.address nor RAY_ADDRESS is set.
        RayClusterError: nothing answers at the address.
    """
    ray = ray_module()
    address = ray_config.resolved_address(dict(environ) if environ is not None else None)
    if ray.is_initialized():
        return False
    _probe(address)
    try:
        ray.init(address=address, _node_ip_address=ray_config.node_ip_address, log_to_driver=False,
                 logging_level=logging.WARNING, configure_logging=False)
    except (ConnectionError, TimeoutError, ValueError, RuntimeError) as problem:
        raise RayClusterError(
            f"train.ray.address (or RAY_ADDRESS) {address!r}: no Ray cluster answers there ({problem}); start one "
            "(`ray start --head`, `tfdag stack up --ray N`) or set the head's address, e.g. '10.0.0.5:6379'") from None
    return True


def _probe(address: str) -> None:
    """Fail fast on a GCS `host:port` that accepts no connection: `ray.init` would retry it for minutes."""
    if "://" in address or address == "auto" or address_problem(address) is not None:
        return  # ray:// (Ray Client), auto, or a form Ray itself will judge
    host, port = split_address(address)
    try:
        socket.create_connection((host, int(port)), timeout=PROBE_TIMEOUT_S).close()
    except OSError as problem:
        raise RayClusterError(
            f"train.ray.address (or RAY_ADDRESS) {address!r}: no Ray cluster answers there ({problem}); start one "
            "(`ray start --head`, `tfdag stack up --ray N`) or set the head's GCS address, e.g. '10.0.0.5:6379'"
        ) from None


def node_name() -> str:
    """The Ray node this code runs on, as errors and summaries name it: `<node id prefix> (<ip>)`."""
    ray = ray_module()
    return f"{ray.get_runtime_context().get_node_id()[:12]} ({ray.util.get_node_ip_address()})"


def resource_options(resources: Mapping[str, float]) -> dict[str, Any]:
    """Ray's options for a task or actor that asks for `resources` (CPU, GPU, memory in bytes, custom names)."""
    builtin = {key: resources[name] for name, key in _BUILTIN.items() if name in resources}
    custom = {name: amount for name, amount in resources.items() if name not in _BUILTIN}
    return {"num_cpus": builtin.get("num_cpus", 0), "num_gpus": builtin.get("num_gpus", 0),
            "memory": builtin.get("memory"), "resources": custom or None}


def on_this_node(error: TfdagError) -> TfdagError:
    """`error` again, its message naming the Ray node it was raised on (in a task or an actor)."""
    return type(error)(f"{error} (on Ray node {node_name()})")


def task_error(error: BaseException) -> BaseException:
    """What to raise for a Ray task's failure: tfdag's own error raised in the task (its one line), else `error`."""
    cause = getattr(error, "cause", None)
    return cause if isinstance(cause, TfdagError) else error
