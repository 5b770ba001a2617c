"""The fault matrix of tests/pipeline_lib/launch/test_fault_matrix.py on the Ray launcher: the same test functions.

The same test functions run here with a harness that starts each run with `launch_on_ray` on the session's Ray
cluster (two tasks on two nodes, `STRICT_SPREAD`): the outside finds each task's worker process, started by its
actor on its node, by the run's marker in its environment; heartbeats, exits and output reach the supervisor
through actor calls. After every case no actor, placement group or worker process of the run is left.
"""

from __future__ import annotations

import functools
import os
import re

import psutil
import pytest

from pipeline_lib.launch.ray_launcher import launch_on_ray
from tests.pipeline_lib.launch import test_fault_matrix as matrix
from tests.pipeline_lib.launch.conftest import dataset  # noqa: F401 - the matrix's data, a fixture
from tests.pipeline_lib.launch_support import make_config
from tests.ray.conftest import RAY_IP

pytestmark = pytest.mark.slow

# A Ray case takes 20–40 s on 2 cores (actors and worker processes start again at every attempt), and the per-phase
# bounds are the supervisor's, launcher-independent and covered by the local matrix (which runs every case). So
# `make test` runs one case per Ray plumbing path: an exit seen through the actor (SIGKILL at the first step: the
# signal, the node in the story, a new attempt's actors) and the preemption exit code through the actor (SIGTERM in the
# last 10 steps: the agreed stop). The other paths are checked by other tests of the default run, named in their skip
# reasons (`COVERED_ELSEWHERE`). `TFDAG_RAY_FAULT_MATRIX=full` runs every case of the matrix here (SIGSTOP while
# saving and finishing among them).
IN_MAKE_TEST = {
    "test_non_chief_sigkilled_at_its_first_step",
    "test_non_chief_preempted_in_its_last_10_steps",
}
_LOCAL = "tests/pipeline_lib/launch/test_fault_matrix.py::"
COVERED_ELSEWHERE = {
    # A hang seen through the actor's heartbeat: the same SIGSTOP of worker 1 while stepping, fenced within its bound,
    # its story and the resume from ckpt-10.
    "test_non_chief_sigstopped_while_stepping_is_caught_as_a_hang":
        "tests/ray/test_ray_launcher.py::test_a_stopped_worker_process_is_fenced_and_restarted",
    # A second restart is the supervisor's (launcher-independent); each attempt's fence and new actors on Ray are
    # checked by every restarting Ray case of the default run.
    "test_a_second_fault_during_the_restart_the_first_caused":
        f"{_LOCAL}test_a_second_fault_during_the_restart_the_first_caused (the supervisor's second restart) with "
        "this module's test_non_chief_sigkilled_at_its_first_step (an attempt fenced and restarted on Ray)",
    # Duplicates of the local matrix's cases: what is checked (which step the restart resumes at, the start-up
    # allowance, the result after the final checkpoint) is the supervisor's and the checkpoints', not the launcher's;
    # the Ray part (an exit seen through the actor, a new attempt's actors, nothing left) is the same as in
    # test_non_chief_sigkilled_at_its_first_step and, for the chief's exit, the raylet SIGKILL's restart.
    "test_chief_sigkilled_during_start_up":
        f"{_LOCAL}test_chief_sigkilled_during_start_up (the same kill at start-up and its restart, on the local "
        "launcher) with this module's test_non_chief_sigkilled_at_its_first_step (a SIGKILL seen through the actor)",
    "test_chief_sigkilled_after_the_final_checkpoint_resumes_at_the_final_step":
        f"{_LOCAL}test_chief_sigkilled_after_the_final_checkpoint_resumes_at_the_final_step (the same resume at the "
        "final step, on the local launcher) with this module's test_non_chief_sigkilled_at_its_first_step (a SIGKILL "
        "seen through the actor) and tests/ray/test_ray_launcher.py's runs (the result read back on Ray)",
}
FULL_MATRIX = os.environ.get("TFDAG_RAY_FAULT_MATRIX") == "full"


def _here(name: str, case):
    """The matrix's case as a test of this module (a new function: marks put on it stay here)."""
    @functools.wraps(case)
    def run_on_ray(*args, **kwargs):
        return case(*args, **kwargs)

    if name in COVERED_ELSEWHERE and not FULL_MATRIX:
        run_on_ray = pytest.mark.skip(reason=f"{COVERED_ELSEWHERE[name]} checks the same in the default run: "
                                             "TFDAG_RAY_FAULT_MATRIX=full runs this duplicate too")(run_on_ray)
    elif not (FULL_MATRIX or name in IN_MAKE_TEST):
        run_on_ray = pytest.mark.skip(reason="one of the Ray matrix's longer runs: TFDAG_RAY_FAULT_MATRIX=full "
                                             "runs it")(run_on_ray)
    return run_on_ray


# Every case of the matrix, collected from this module: they take the `harness` below.
globals().update({name: _here(name, case) for name, case in vars(matrix).items() if name.startswith("test_")})
assert IN_MAKE_TEST | set(COVERED_ELSEWHERE) <= {name for name in vars(matrix) if name.startswith("test_")}
assert not IN_MAKE_TEST & set(COVERED_ELSEWHERE)


_NODE = re.compile(r" on node [0-9.]+ \(Ray node [0-9a-f]+\)")


class RayHarness(matrix.Harness):
    """The matrix's runs on the Ray launcher."""

    startup_allowance_s = 40.0  # an actor starts, then its worker process imports TensorFlow
    forks_workers = False  # a Ray task starts its worker with a plain `python -m`, its heartbeats on its node

    def __init__(self, root: str, cluster):
        super().__init__(root)
        self.cluster = cluster

    def config(self, **train):
        ray = {"address": self.cluster.address, "node_ip_address": RAY_IP, "resources_per_worker": {"CPU": 1},
               "placement_timeout_s": 60}
        return make_config(self.root, launcher="ray", ray=ray, **train)

    def launch(self, spec, config, **kwargs):
        return launch_on_ray(spec, config, **kwargs)

    def plain(self, text: str) -> str:
        """A restart story without the node it names on Ray (`worker 1 killed by SIGKILL on node 127.0.0.2 (Ray node
        e91cbaccfe04)`), which every exit story here must carry."""
        if re.search(r"(killed by|exited) ", text):
            assert _NODE.search(text), f"a Ray exit story names no node: {text}"
        return _NODE.sub("", text)

    def assert_nothing_left(self) -> None:
        assert self.cluster.alive_actors() == []
        assert self.cluster.live_placement_groups() == []
        left = [proc.pid for proc in psutil.process_iter(["cmdline"])
                if "pipeline_lib.launch.worker" in " ".join(proc.info["cmdline"] or []) and _marked(proc, self.root)]
        assert left == [], f"worker processes of this run left behind: {left}"


def _marked(proc: psutil.Process, root: str) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE and proc.environ().get(matrix.Harness.MARKER_ENV) == root
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


@pytest.fixture
def harness(tmp_path, ray_cluster):
    harness = RayHarness(str(tmp_path), ray_cluster)
    yield harness
    harness.assert_nothing_left()
