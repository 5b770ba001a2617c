"""Test-only: fake a node loss for the local launcher's elastic runs with a file of how many local "nodes" are up.

The local launcher places every worker on this machine (`LocalGroup.capacity` is train.workers). Within
`local_nodes(path)` every local group asks `path` instead: it holds how many of the workers can be placed now (a
lost node is "2" for 3 workers; rewriting it "3" is the node's return), and a capacity question waits up to its
`wait_s` for all of them, as it would for a cluster's nodes. The launcher runs in the test's own process (`launch`
directly, or a flow the test runs), so replacing the group's public `capacity` there is enough.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from unittest import mock

from pipeline_lib.launch.local import LocalGroup

POLL_S = 0.2


def nodes_up(path: str | os.PathLike, wanted: int) -> int:
    """How many nodes `path` says are up; `wanted` when it cannot be read (not written yet, or half written)."""
    try:
        with open(path) as handle:
            return int(handle.read().strip())
    except (OSError, ValueError):
        return wanted


def capacity(path: str | os.PathLike, wanted: int, wait_s: float) -> int:
    """The workers of `wanted` that can be placed by `path`, waiting up to `wait_s` for all of them."""
    deadline = time.monotonic() + wait_s
    while True:
        up = nodes_up(path, wanted)
        if up >= wanted or time.monotonic() >= deadline:
            return max(0, min(up, wanted))
        time.sleep(POLL_S)


@contextlib.contextmanager
def local_nodes(path: str | os.PathLike) -> Iterator[None]:
    """Within the block, every local group's capacity is what the file at `path` says (see the module docstring)."""

    def file_capacity(group: LocalGroup, wait_s: float) -> int:
        return capacity(path, group.config.train.workers, wait_s)

    with mock.patch.object(LocalGroup, "capacity", file_capacity):
        yield
