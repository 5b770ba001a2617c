"""Tests for pipeline_lib.testing.local_nodes: the local group's capacity from a file of the nodes up."""

from __future__ import annotations

import threading
import time

from pipeline_lib.config import parse_config
from pipeline_lib.launch.local import LocalGroup
from pipeline_lib.testing.local_nodes import capacity, local_nodes


def _group(workers: int) -> LocalGroup:
    group = LocalGroup.__new__(LocalGroup)  # capacity needs only the config: no spec file, no work dir
    group.config = parse_config({"name": "x", "data": {"source": "x.csv", "label": "y"},
                                 "train": {"workers": workers, "elastic": {"min_workers": 1}}})
    return group


def test_the_group_places_every_worker_unless_the_file_says_fewer(tmp_path):
    nodes = tmp_path / "nodes"
    nodes.write_text("2")
    group = _group(3)
    assert group.capacity(0) == 3
    with local_nodes(nodes):
        assert group.capacity(0) == 2
        nodes.write_text("5")
        assert group.capacity(0) == 3  # never more than train.workers
    nodes.write_text("1")
    assert group.capacity(0) == 3  # the block is over


def test_capacity_waits_for_the_nodes_to_return_and_reads_an_unwritten_file_as_all(tmp_path):
    nodes = tmp_path / "nodes"
    assert capacity(nodes, 3, 0) == 3
    nodes.write_text("2")
    threading.Timer(0.3, nodes.write_text, args=("3",)).start()
    started = time.monotonic()
    assert capacity(nodes, 3, 10) == 3 and time.monotonic() - started < 5
    nodes.write_text("1")
    assert capacity(nodes, 3, 0.3) == 1
