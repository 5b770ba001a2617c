"""How many training workers a Ray cluster's nodes can hold: the count behind the Ray launcher's elastic capacity and
its cluster check, on the node records `ray.nodes()` returns (no Ray import)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pipeline_lib.config import PipelineConfig, RayPlacement


def num_kept_tasks(config: PipelineConfig) -> int:
    """The tasks of every attempt besides its training workers: under parameter_server the chief (the coordinator)
    and the servers, which an elastic run keeps whatever its worker count; none otherwise."""
    train = config.train
    return 1 + train.parameter_servers if train.uses_parameter_server() else 0


def node_fits(node: Mapping[str, Any], bundle: Mapping[str, float]) -> bool:
    """True when the node's total resources hold one bundle."""
    return bundles_on(node, bundle) >= 1


def bundles_on(node: Mapping[str, Any], bundle: Mapping[str, float]) -> int:
    """How many bundles the node's total resources hold (train.ray.resources_per_worker reserves some resource, so
    at least one amount is positive)."""
    resources = node.get("Resources", {})
    return min(int(resources.get(name, 0.0) // amount) for name, amount in bundle.items() if amount > 0)


def placeable_workers(config: PipelineConfig, nodes: Sequence[Mapping[str, Any]]) -> int:
    """The training workers `nodes` could hold for `config`, at most train.workers.

    Every task takes one bundle of train.ray.resources_per_worker: one per fitting node under `spread`
    (STRICT_SPREAD), as many as fit under `pack`. The tasks every attempt keeps whatever its worker count (a
    parameter-server run's chief and servers, `num_kept_tasks`) take theirs first.
    """
    ray_config = config.train.ray
    bundle = ray_config.resources_per_worker
    if ray_config.placement == RayPlacement.SPREAD:
        bundles = sum(node_fits(node, bundle) for node in nodes)
    else:
        bundles = sum(bundles_on(node, bundle) for node in nodes)
    return max(0, min(bundles - num_kept_tasks(config), config.train.workers))
