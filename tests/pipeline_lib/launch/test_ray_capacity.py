"""The Ray launcher's elastic capacity, counted on plain node records (what `ray.nodes()` returns): no Ray cluster."""

from __future__ import annotations

import pytest

from pipeline_lib.config import parse_config
from pipeline_lib.launch.ray_capacity import placeable_workers


def _config(placement: str, resources: dict[str, float], parameter_servers: int = 0):
    train = {"workers": 3, "launcher": "ray", "elastic": {"min_workers": 2},
             "ray": {"placement": placement, "resources_per_worker": resources}}
    if parameter_servers:
        train.update(strategy="parameter_server", parameter_servers=parameter_servers)
    return parse_config({"name": "x", "data": {"source": "x.csv", "label": "y"}, "train": train})


def _nodes(*resources: dict[str, float]) -> list[dict]:
    return [{"NodeID": f"n{i}", "Alive": True, "Resources": r} for i, r in enumerate(resources)]


@pytest.mark.parametrize(("nodes", "expected"), [
    (_nodes({"CPU": 4}, {"CPU": 1}, {"CPU": 0.5}), 2),  # one task per fitting node, however large the node
    (_nodes(*[{"CPU": 1}] * 5), 3),  # never more than train.workers
    (_nodes({"GPU": 1}, {}), 0),  # no CPU, no Resources at all
])
def test_spread_counts_one_worker_per_node_that_holds_a_bundle(nodes, expected):
    assert placeable_workers(_config("spread", {"CPU": 1}), nodes) == expected


@pytest.mark.parametrize(("resources", "nodes", "expected"), [
    ({"CPU": 2}, _nodes({"CPU": 5}, {"CPU": 1.5}), 2),  # floor(5 / 2) + floor(1.5 / 2)
    ({"CPU": 1, "accel": 1}, _nodes({"CPU": 8, "accel": 2}), 2),  # the scarcest resource decides
    ({"CPU": 1, "GPU": 0}, _nodes({"CPU": 8}), 3),  # an amount of 0 asks for nothing
])
def test_pack_counts_the_bundles_each_nodes_total_resources_hold(resources, nodes, expected):
    assert placeable_workers(_config("pack", resources), nodes) == expected


@pytest.mark.parametrize(("placement", "nodes", "expected"), [
    ("spread", _nodes(*[{"CPU": 1}] * 5), 3),  # chief + ps + 3 workers
    ("spread", _nodes(*[{"CPU": 1}] * 4), 2),
    ("spread", _nodes({"CPU": 1}), 0),  # not even the kept tasks: none, not -1
    ("pack", _nodes({"CPU": 4}), 2),
    ("pack", _nodes({"CPU": 4}, {"CPU": 4}), 3),
])
def test_a_parameter_server_runs_chief_and_servers_take_their_bundles_first(placement, nodes, expected):
    assert placeable_workers(_config(placement, {"CPU": 1}, parameter_servers=1), nodes) == expected
