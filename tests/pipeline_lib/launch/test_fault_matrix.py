"""Faults at the edges of a run, with real signals to real worker processes: every case ends with the exact step
count and a completed run.

Most signals come from outside, as an operator or an orchestrator sends them: a thread finds the task's process
by its TF_CONFIG and this test's marker in its environment (psutil) and signals it. Where a window is too short to
hit from outside (the moment after the final checkpoint, a given step), a test-only `sleep` fault holds the worker
there for a moment that is shorter than every bound, and the outside signal lands during it. The others use the
TFDAG_FAULT hooks alone. tests/ray/test_ray_fault_matrix.py runs every case again on the Ray launcher.

Each case trains 2 workers × 16 examples on 512 rows (16 steps an epoch) for 30 steps, a checkpoint every 10,
with `hang_timeout_s` 5, the shortest this 2-core machine allows with a second test process beside it (at 3, a
final save and evaluation after a 5 s pause outlasted the 9 s finishing bound): stepping may be silent 5 s, saving
and finishing 15 s; starting 125 s, which the one starting-hang case shortens for itself
(the supervisor's STARTUP_ALLOWANCE_S, monkeypatched to 25 s here). One case runs the issue's own setting,
`hang_timeout_s` 20 with a 25 s finish, while busy loops hold every core: it holds the whole machine for a minute, so
it runs with `TFDAG_FAULT_MATRIX=full` (`make test` leaves it out, as it leaves out the Ray matrix's longer cases).
So do the cases marked `duplicate_of`: their guarantee is checked in the default run by the test their skip reason
names (the chief's preemption, its kill mid-checkpoint, at its first step and at the result write, a non-chief's kill
while saving and while restoring in a restart, the chief's SIGSTOP while saving), and, here only (a call, not a mark:
Ray's default run keeps its copy), the non-chief's kill at its first step. The default run keeps one case per
mechanism: a kill at start-up and after the final checkpoint, a hang fenced while starting, stepping and finishing,
a preemption, a second fault during a restart, a slow save and finish not fenced, a stop after the result not fenced.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import psutil
import pytest

from pipeline_lib.checkpoints import manifests
from pipeline_lib.launch import supervisor
from pipeline_lib.launch.heartbeat import read_heartbeat
from pipeline_lib.launch.local import LaunchResult, launch
from pipeline_lib.launch.spec import PREEMPTION_EXIT_CODE, RESULT_NAME, WorkerSpec
from pipeline_lib.launch.supervisor import phase_bound_s
from pipeline_lib.training.hooks import Phase
from tests.pipeline_lib.launch_support import (
    LogCapture,
    assert_no_orphans,
    make_config,
    make_spec,
    plan_for,
)

pytestmark = pytest.mark.slow

TOTAL_STEPS = 30
HANG_TIMEOUT_S = 5.0
# The cases that hold the whole machine run only when asked for (see the module docstring).
FULL_MATRIX = "full" in (os.environ.get("TFDAG_FAULT_MATRIX"), os.environ.get("TFDAG_RAY_FAULT_MATRIX"))


def duplicate_of(covered_by: str):
    """A case whose guarantee `covered_by`, a test of the default run, checks too: it runs with the full matrix only.

    The mark travels with the function, so tests/ray/test_ray_fault_matrix.py's copy of the case carries it as well.
    """
    return pytest.mark.skipif(not FULL_MATRIX, reason=f"{covered_by} checks the same in the default run: "
                                                      "TFDAG_FAULT_MATRIX=full runs this duplicate too")


def skip_here_as_a_duplicate_of(harness: Harness, covered_by: str) -> None:
    """Like `duplicate_of`, for this module's local run only: a case whose copy in tests/ray/test_ray_fault_matrix.py
    checks a Ray plumbing path of its own (Ray's default run keeps it), while here another case of the default run
    checks the same. A call in the test, not a mark: a mark would travel to the Ray copy."""
    if not FULL_MATRIX and type(harness) is Harness:
        pytest.skip(f"{covered_by} checks the same in the default run: "
                    "TFDAG_FAULT_MATRIX=full runs this duplicate too")


class Harness:
    """How the matrix starts a run and reaches its tasks' processes: here the local launcher's.

    tests/ray/test_ray_fault_matrix.py runs the same cases through a subclass on a Ray cluster. Each run's worker
    processes carry `MARKER_ENV` (this test's own value) in their environment, so the outside finds them wherever
    a launcher starts them: the local launcher's children or the processes of Ray actors on other nodes.
    """

    MARKER_ENV = "TFDAG_FAULT_MATRIX_RUN"
    # The starting allowance the starting-hang case uses in place of the production 120 s: enough for a task of this
    # launcher to import TensorFlow and restore on a busy 2-core machine.
    startup_allowance_s = 25.0
    # The local launcher forks its workers from its fork server (pipeline_lib.launch.forkserver): their environment
    # in /proc is the server's, so they are found by their heartbeats' pids, and their heartbeats read in the spec's
    # heartbeat directory.
    forks_workers = True

    def __init__(self, root: str):
        self.root = root
        self.heartbeat_dir: str | None = None

    def config(self, **train):
        return make_config(self.root, **train)

    def launch(self, spec: WorkerSpec, config, **kwargs) -> LaunchResult:
        return launch(spec, config, **kwargs)

    def assert_nothing_left(self) -> None:
        assert_no_orphans()

    def plain(self, text: str) -> str:
        """`text` with what only this launcher adds to a restart story taken out (nothing here)."""
        return text

    def setup(self, dataset, *, hang_timeout_s: float = HANG_TIMEOUT_S):
        config = self.config(workers=2, per_replica_batch_size=16, hang_timeout_s=hang_timeout_s,
                             restart_backoff_s=0.1)
        plan = plan_for(dataset, config, steps=TOTAL_STEPS)
        spec = make_spec(config, dataset, plan, os.path.join(self.root, "run"))
        self.heartbeat_dir = spec.heartbeat_dir if self.forks_workers else None
        return config, spec

    def find_process(self, worker_index: int) -> psutil.Process | None:
        """The running worker process of this run whose TF_CONFIG names `worker <worker_index>`."""
        for proc in psutil.process_iter(["cmdline"]):
            try:
                if "pipeline_lib.launch.worker" not in " ".join(proc.info["cmdline"] or []):
                    continue
                if proc.status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
                    continue
                environ = proc.environ()
                if environ.get(self.MARKER_ENV) != self.root:
                    continue
                task = json.loads(environ.get("TF_CONFIG", "{}")).get("task", {})
            except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
                continue
            if task.get("type") == "worker" and task.get("index") == worker_index:
                return proc
        return self._forked_process(worker_index)

    def _forked_process(self, worker_index: int) -> psutil.Process | None:
        """A worker the local launcher's fork server started: its environment is the server's (what Linux shows in
        /proc), so it is found by the pid its heartbeat names, once it wrote one."""
        beat = read_heartbeat(os.path.join(self.heartbeat_dir, f"worker-{worker_index}.json")) if self.heartbeat_dir \
            else None
        try:
            proc = psutil.Process(int(beat["pid"])) if beat else None
            if proc is not None and proc.status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD) \
                    and "pipeline_lib.launch.worker" in " ".join(proc.cmdline()):
                return proc
        except (psutil.NoSuchProcess, psutil.AccessDenied, KeyError, ValueError):
            pass
        return None

    def beat(self, worker_index: int) -> dict:
        """The running worker's latest heartbeat, from the directory its spec names ({} when there is none)."""
        if self.heartbeat_dir:
            return read_heartbeat(os.path.join(self.heartbeat_dir, f"worker-{worker_index}.json")) or {}
        proc = self.find_process(worker_index)
        try:
            args = proc.cmdline() if proc is not None else []
            spec = WorkerSpec.model_validate_json(pathlib.Path(args[args.index("--spec") + 1]).read_text())
        except (psutil.NoSuchProcess, ValueError, IndexError, OSError):
            return {}
        return read_heartbeat(os.path.join(spec.heartbeat_dir, f"worker-{worker_index}.json")) or {}

    def run(self, spec: WorkerSpec, config, outside: Outside | None = None, fault: str | None = None,
            logs: LogCapture | None = None):
        logs, calls = logs if logs is not None else LogCapture(), []
        env = {self.MARKER_ENV: self.root, **({"TFDAG_FAULT": fault} if fault else {})}
        if outside is not None:
            outside.start()
        try:
            outcome = self.launch(spec, config, log_fn=logs, on_restart=lambda n, story: calls.append((n, self.plain(story))),
                                  env=env)
        finally:
            if outside is not None:
                outside.stop.set()
                outside.join()
        if outside is not None:
            assert outside.sent_at is not None, f"the outside {outside.signum.name} was never sent"
        return outcome, calls, logs


@pytest.fixture
def harness(tmp_path):
    harness = Harness(str(tmp_path))
    yield harness
    harness.assert_nothing_left()


class Outside(threading.Thread):
    """Sends `signum` to worker `worker_index` from outside once `when()` holds (polled), at most once."""

    def __init__(self, harness: Harness, when: Callable[[], bool], worker_index: int, signum: signal.Signals,
                 timeout_s: float = 240):
        super().__init__(daemon=True)
        self.harness, self.when, self.worker_index, self.signum = harness, when, worker_index, signum
        self.timeout_s = timeout_s
        self.sent_at: float | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not self.stop.is_set() and time.monotonic() < deadline:
            if self.when():
                proc = self.harness.find_process(self.worker_index)
                if proc is not None:
                    proc.send_signal(self.signum)
                    self.sent_at = time.monotonic()
                    return
            time.sleep(0.05)


def _assert_complete(outcome: LaunchResult, spec: WorkerSpec, *, restarts: int) -> None:
    result = outcome.result
    assert result.final_step == result.total_steps == TOTAL_STEPS
    assert result.num_restarts == len(result.restarts) == restarts
    checkpoint = manifests.latest_valid(os.path.join(spec.run_dir, "checkpoints"))
    assert checkpoint.step == TOTAL_STEPS
    assert result.final_loss == pytest.approx(checkpoint.metrics["train_loss"])


def _log_has(logs: LogCapture, needle: str) -> Callable[[], bool]:
    return lambda: needle in logs.text


# --- the finish --------------------------------------------------------------------------------------------------

def test_chief_sigkilled_after_the_final_checkpoint_resumes_at_the_final_step(harness, dataset):
    # Outside. The chief is held after its final checkpoint, before result.json; SIGKILL lands there.
    config, spec = harness.setup(dataset)
    logs = LogCapture()
    outside = Outside(harness, _log_has(logs, "sleep fires in worker 0 entering phase result"), 0, signal.SIGKILL)
    outcome, calls, logs = harness.run(spec, config, outside, logs=logs,
                                        fault="sleep:worker=0:phase=result:seconds=60")
    _assert_complete(outcome, spec, restarts=1)
    story = ("worker 0 killed by SIGKILL; resumed at step 30 of 30, the final step: nothing left to train, the "
             "result comes from its checkpoint")
    assert calls == [(1, story)]
    assert outcome.result.start_step == TOTAL_STEPS and outcome.result.restarts[0].resumed_step == TOTAL_STEPS
    assert f"[supervisor] restart 1: {story}" in harness.plain(logs.text)
    assert [c.step for c in outcome.result.checkpoints] == [10, 20, 30]


def test_a_slow_save_and_a_slow_finish_are_not_fenced(harness, dataset):
    # TFDAG_FAULT. Each pause outlasts hang_timeout_s (5 s) but not the saving and finishing bound (15 s); the
    # other worker waits meanwhile in its next step's collective, which the slowest phase bounds too.
    config, spec = harness.setup(dataset)
    pause = 6
    assert HANG_TIMEOUT_S < pause < phase_bound_s(Phase.FINISHING, HANG_TIMEOUT_S)
    outcome, calls, logs = harness.run(
        spec, config, fault=f"sleep:worker=0:phase=saving:seconds={pause},"
                            f"sleep:worker=0:phase=finishing:seconds={pause}")
    assert "sleep fires in worker 0 entering phase saving" in logs.text
    assert "sleep fires in worker 0 entering phase finishing" in logs.text
    assert calls == [] and outcome.num_attempts == 1
    _assert_complete(outcome, spec, restarts=0)


@pytest.mark.skipif(not FULL_MATRIX, reason="holds every core for a minute: TFDAG_FAULT_MATRIX=full runs it")
def test_a_slow_finish_on_a_loaded_machine_is_not_fenced_under_the_documented_bound(harness, dataset):
    # The case: hang_timeout_s 20 on a busy machine. Two busy loops hold both cores while the chief takes
    # 25 s to finish (longer than H, shorter than the finishing bound 3 × H): one attempt, nothing fenced.
    config, spec = harness.setup(dataset, hang_timeout_s=20.0)
    pause = 25
    assert 20.0 < pause < phase_bound_s(Phase.FINISHING, 20.0)
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
    try:
        outcome, calls, logs = harness.run(spec, config, fault=f"sleep:worker=0:phase=finishing:seconds={pause}")
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
    assert "sleep fires in worker 0 entering phase finishing" in logs.text
    assert calls == [] and outcome.num_attempts == 1
    _assert_complete(outcome, spec, restarts=0)


def test_chief_sigstopped_while_finishing_is_caught_as_a_hang(harness, dataset):
    # Outside. Held for 2 s as it enters the finishing phase (before the final save), then stopped.
    config, spec = harness.setup(dataset)
    logs = LogCapture()
    outside = Outside(harness, _log_has(logs, "sleep fires in worker 0 entering phase finishing"), 0, signal.SIGSTOP)
    outcome, calls, logs = harness.run(spec, config, outside, logs=logs,
                                        fault="sleep:worker=0:phase=finishing:seconds=2")
    _assert_complete(outcome, spec, restarts=1)
    (_, story), = calls
    assert story.startswith("hang: worker 0 (stopped) made no progress"), story
    assert f"finishing (bound {3 * HANG_TIMEOUT_S:g} s = 3 × train.hang_timeout_s {HANG_TIMEOUT_S:g} s)" in story
    assert story.endswith("resumed at step 20 of 30")
    detected_after = logs.first_time("[supervisor] restart 1/") - outside.sent_at
    assert phase_bound_s(Phase.FINISHING, HANG_TIMEOUT_S) - 2.5 <= detected_after <= 30.0, detected_after


# --- stepping and saving -----------------------------------------------------------------------------------------

def test_non_chief_sigstopped_while_stepping_is_caught_as_a_hang(harness, dataset):
    # Outside. Worker 1 pauses 2 s after step 12 (within hang_timeout_s) and is stopped during the pause.
    config, spec = harness.setup(dataset)
    logs = LogCapture()
    outside = Outside(harness, _log_has(logs, "sleep fires in worker 1 after step 12"), 1, signal.SIGSTOP)
    outcome, calls, logs = harness.run(spec, config, outside, logs=logs,
                                        fault="sleep:worker=1:step=12:seconds=2")
    _assert_complete(outcome, spec, restarts=1)
    (_, story), = calls
    # The watchdog, or TensorFlow noticing first and worker 0 aborting its all-reduce: both name worker 1.
    assert story.startswith("hang: worker 1 (stopped) made no progress"), story
    assert story.endswith("resumed at step 10 of 30")
    detected_after = logs.first_time("[supervisor] restart 1/") - outside.sent_at
    assert detected_after <= HANG_TIMEOUT_S + 10.0, detected_after


@duplicate_of("test_fault_matrix.py::test_chief_sigstopped_while_finishing_is_caught_as_a_hang (the same watchdog "
              "fence of a stopped chief under the same 3 × hang_timeout_s bound, which saving and finishing share, "
              "with the bound named in the story) with test_chief_sigkilled_during_start_up (the restart from step 0 "
              "when no checkpoint is committed yet)")
def test_chief_sigstopped_while_saving_is_caught_as_a_hang(harness, dataset):
    # TFDAG_FAULT: the chief stops itself as it enters its first save (step 10): no checkpoint yet.
    config, spec = harness.setup(dataset)
    outcome, calls, _ = harness.run(spec, config, fault="stop:worker=0:phase=saving")
    _assert_complete(outcome, spec, restarts=1)
    (_, story), = calls
    assert story.startswith("hang: worker 0 (stopped) made no progress"), story
    assert story.endswith("no checkpoint yet: started again at step 0 of 30")


# --- kills at the start and during a restart --------------------------------------------------------------------

def test_non_chief_sigkilled_at_its_first_step(harness, dataset):
    # Outside. Worker 1 pauses 2 s after its first step and is killed during the pause.
    skip_here_as_a_duplicate_of(
        harness, "test_fault_matrix.py::test_chief_sigkilled_during_start_up (an outside SIGKILL before any "
                 "checkpoint, the restart from step 0, start step 0) with test_a_second_fault_during_the_restart_the_"
                 "first_caused (a non-chief SIGKILLed while stepping, named in the story, the restart in the same "
                 "launch)")
    config, spec = harness.setup(dataset)
    logs = LogCapture()
    outside = Outside(harness, _log_has(logs, "sleep fires in worker 1 after step 1"), 1, signal.SIGKILL)
    outcome, calls, _ = harness.run(spec, config, outside, logs=logs,
                                        fault="sleep:worker=1:step=1:seconds=2")
    _assert_complete(outcome, spec, restarts=1)
    (_, story), = calls
    assert "worker 1" in story and story.endswith("no checkpoint yet: started again at step 0 of 30"), story
    assert outcome.result.start_step == 0


def test_a_second_fault_during_the_restart_the_first_caused(harness, dataset):
    # TFDAG_FAULT kills worker 1 at step 15; the outside kills the restarted chief once it has restored step 10.
    config, spec = harness.setup(dataset)
    logs = LogCapture()

    def restored_after_the_first_fault() -> bool:
        return "[supervisor] restart 1/" in logs.text and harness.beat(0).get("start_step") == 10

    outside = Outside(harness, restored_after_the_first_fault, 0, signal.SIGKILL)
    outcome, calls, _ = harness.run(spec, config, outside, logs=logs,
                                        fault="kill:worker=1:step=15")
    _assert_complete(outcome, spec, restarts=2)
    assert calls[0] == (1, "worker 1 killed by SIGKILL; resumed at step 10 of 30")
    number, story = calls[1]
    # Usually before its first step; if the restarted group got on to step 20 first, it resumes from there.
    assert number == 2 and story.startswith("worker 0 killed by SIGKILL; resumed at step "), story
    assert outcome.result.restarts[1].resumed_step in (10, 20)


# --- preemption --------------------------------------------------------------------------------------------------

def test_non_chief_preempted_in_its_last_10_steps(harness, dataset):
    # Outside SIGTERM while worker 1 pauses after step 25: both stop at the same step, checkpoint, exit 138.
    config, spec = harness.setup(dataset)
    logs = LogCapture()
    outside = Outside(harness, _log_has(logs, "sleep fires in worker 1 after step 25"), 1, signal.SIGTERM)
    outcome, calls, logs = harness.run(spec, config, outside, logs=logs,
                                        fault="sleep:worker=1:step=25:seconds=2")
    _assert_complete(outcome, spec, restarts=1)
    (_, story), = calls
    assert f"exited {PREEMPTION_EXIT_CODE} (preempted" in story, story
    resumed = outcome.result.restarts[0].resumed_step
    assert TOTAL_STEPS - 10 <= 25 <= resumed < TOTAL_STEPS
    assert f"worker 0 preempted at step {resumed}" in logs.text and f"worker 1 preempted at step {resumed}" in logs.text


# The group's stop is one all-reduce of every worker's request (training/agreement.py), so which worker gets the
# SIGTERM does not change the path; a chief's own SIGTERM (checkpoint, exit 138) is
# tests/pipeline_lib/launch/test_worker.py::test_sigterm_checkpoints_and_exits_with_the_preemption_code.
@duplicate_of("test_fault_matrix.py::test_non_chief_preempted_in_its_last_10_steps (the same agreed stop, checkpoint "
              "and exit 138 of both workers) with test_worker.py::test_sigterm_checkpoints_and_exits_with_the_"
              "preemption_code (a chief's own SIGTERM)")
def test_chief_preempted_in_its_last_10_steps(harness, dataset):
    # Outside SIGTERM to the chief while it pauses after step 25: the same coordinated checkpoint, exit 138.
    config, spec = harness.setup(dataset)
    logs = LogCapture()
    outside = Outside(harness, _log_has(logs, "sleep fires in worker 0 after step 25"), 0, signal.SIGTERM)
    outcome, calls, logs = harness.run(spec, config, outside, logs=logs,
                                        fault="sleep:worker=0:step=25:seconds=2")
    _assert_complete(outcome, spec, restarts=1)
    (_, story), = calls
    # Both workers stop at the same step and exit 138 together; the story names the first exit seen.
    assert f"exited {PREEMPTION_EXIT_CODE} (preempted" in story, story
    resumed = outcome.result.restarts[0].resumed_step
    assert TOTAL_STEPS - 10 <= 25 <= resumed < TOTAL_STEPS
    assert f"worker 0 preempted at step {resumed}" in logs.text and f"worker 1 preempted at step {resumed}" in logs.text


# --- more kills at the start and during a restart ---------------------------------------------------------------

def test_chief_sigkilled_during_start_up(harness, dataset):
    # Outside, no TFDAG_FAULT: the chief is killed as soon as its first heartbeat (starting, nothing restored
    # yet) is on disk: during its import, preflight and strategy set-up, before any step.
    config, spec = harness.setup(dataset)

    def starting_before_restore() -> bool:
        beat = harness.beat(0)
        return beat.get("phase") == Phase.STARTING.value and beat.get("start_step") is None

    outside = Outside(harness, starting_before_restore, 0, signal.SIGKILL)
    outcome, calls, _ = harness.run(spec, config, outside)
    _assert_complete(outcome, spec, restarts=1)
    (_, story), = calls
    assert story.startswith("worker 0 killed by SIGKILL"), story
    assert story.endswith("no checkpoint yet: started again at step 0 of 30"), story
    assert outcome.result.start_step == 0


@duplicate_of("test_fault_matrix.py::test_chief_sigkilled_during_start_up (the chief's outside SIGKILL before any "
              "checkpoint, the restart from step 0, start step 0) with test_a_second_fault_during_the_restart_the_"
              "first_caused (a SIGKILL while stepping, the restart in the same launch)")
def test_chief_sigkilled_at_its_first_step(harness, dataset):
    # Outside. The chief pauses 2 s after its first step and is killed during the pause.
    config, spec = harness.setup(dataset)
    logs = LogCapture()
    outside = Outside(harness, _log_has(logs, "sleep fires in worker 0 after step 1"), 0, signal.SIGKILL)
    outcome, calls, _ = harness.run(spec, config, outside, logs=logs,
                                     fault="sleep:worker=0:step=1:seconds=2")
    _assert_complete(outcome, spec, restarts=1)
    (_, story), = calls
    assert story == "worker 0 killed by SIGKILL; no checkpoint yet: started again at step 0 of 30", story
    assert outcome.result.start_step == 0


@duplicate_of("test_fault_matrix.py::test_a_second_fault_during_the_restart_the_first_caused (a second "
              "SIGKILL, from outside, during the restart the first fault caused: two restarts, each story, the resume "
              "from ckpt-10 to step 30)")
def test_non_chief_sigkilled_while_restoring_in_the_restart(harness, dataset):
    # TFDAG_FAULT kills the chief at step 15 (ckpt-10 exists); the outside kills worker 1 in the starting phase
    # of the restarted attempt (import, preflight, restore of ckpt-10), before its first step.
    config, spec = harness.setup(dataset)
    logs = LogCapture()

    def starting_in_the_restart() -> bool:
        return "[supervisor] restart 1/" in logs.text and harness.beat(1).get("phase") == Phase.STARTING.value

    outside = Outside(harness, starting_in_the_restart, 1, signal.SIGKILL)
    outcome, calls, _ = harness.run(spec, config, outside, logs=logs, fault="kill:worker=0:step=15")
    _assert_complete(outcome, spec, restarts=2)
    # Restart 1's group usually fails before its chief restored ckpt-10 (its story says so), else it resumed there.
    assert calls[0] in ((1, "worker 0 killed by SIGKILL; the restarted group failed before it restored a checkpoint"),
                        (1, "worker 0 killed by SIGKILL; resumed at step 10 of 30")), calls
    assert calls[1] == (2, "worker 1 killed by SIGKILL; resumed at step 10 of 30"), calls
    assert outcome.result.restarts[0].resumed_step in (None, 10) and outcome.result.restarts[1].resumed_step == 10
    assert outcome.result.start_step == 10


# --- more kills mid-checkpoint and at the result -------------------------------------------------------------------

@duplicate_of("test_local.py::test_chief_killed_during_a_save_leaves_the_previous_checkpoint_latest (a kill inside "
              "a save, the uncommitted checkpoint ignored) with test_fault_matrix.py::test_a_second_fault_during_the_"
              "restart_the_first_caused (a non-chief's SIGKILL named in the story, the resume in the same launch)")
def test_non_chief_sigkilled_while_saving(harness, dataset):
    # Outside. Worker 1 pauses 2 s as it enters its first save (step 10) and is killed during the pause.
    config, spec = harness.setup(dataset)
    logs = LogCapture()
    outside = Outside(harness, _log_has(logs, "sleep fires in worker 1 entering phase saving"), 1, signal.SIGKILL)
    outcome, calls, _ = harness.run(spec, config, outside, logs=logs,
                                     fault="sleep:worker=1:phase=saving:seconds=2")
    _assert_complete(outcome, spec, restarts=1)
    (_, story), = calls
    assert "worker 1" in story, story
    resumed = outcome.result.restarts[0].resumed_step
    # The chief may have finished ckpt-10 on its own before it missed its peer: then it resumes from there.
    assert resumed in (0, 10), story
    assert story.endswith("no checkpoint yet: started again at step 0 of 30" if resumed == 0
                          else "resumed at step 10 of 30"), story


@duplicate_of("test_local.py::test_chief_killed_during_a_save_leaves_the_previous_checkpoint_latest (the same kill of "
              "a 2-worker chief inside its step-20 save, ckpt-20 uncommitted, the resume from ckpt-10 to step 30) with "
              "test_local.py::test_sigkill_of_the_chief_mid_epoch_restarts_and_finishes_exactly_total_steps (the "
              "restart in the same launch from the latest valid checkpoint)")
def test_chief_sigkilled_mid_checkpoint_resumes_from_the_previous_one(harness, dataset):
    # TFDAG_FAULT: the chief kills itself inside its second save (step 20), after the checkpoint's data and index
    # are written, before its manifest: ckpt-20 is not valid, the restart in the same launch resumes from ckpt-10.
    config, spec = harness.setup(dataset)
    outcome, calls, logs = harness.run(spec, config, fault="kill_during_save:worker=0")
    assert "kill_during_save fires in worker 0 while saving checkpoint" in logs.text
    _assert_complete(outcome, spec, restarts=1)
    assert calls == [(1, "worker 0 killed by SIGKILL; resumed at step 10 of 30")], calls
    assert outcome.num_attempts == 2 and outcome.result.start_step == 10
    assert [c.step for c in outcome.result.checkpoints][-1] == TOTAL_STEPS


@duplicate_of("test_fault_matrix.py::test_chief_sigkilled_after_the_final_checkpoint_resumes_at_the_final_step (a "
              "SIGKILL of the chief at the same result point, with the same story, start step and more)")
def test_chief_sigkilled_at_the_result_write(harness, dataset):
    # TFDAG_FAULT: the chief kills itself at the result point, right before its atomic result.json write
    # (the write itself is a rename: there is no half-written result to reach).
    config, spec = harness.setup(dataset)
    outcome, calls, _ = harness.run(spec, config, fault="kill:worker=0:phase=result")
    _assert_complete(outcome, spec, restarts=1)
    story = ("worker 0 killed by SIGKILL; resumed at step 30 of 30, the final step: nothing left to train, the "
             "result comes from its checkpoint")
    assert calls == [(1, story)], calls
    assert outcome.result.start_step == TOTAL_STEPS


# --- more hangs ------------------------------------------------------------------------------------------------

def test_non_chief_sigstopped_while_starting_is_caught_as_a_hang(harness, dataset, monkeypatch):
    # Outside. The starting allowance (120 s in production) is shortened for this test only (the harness says how
    # much a task's start needs with its launcher): the bound logic is the same. Worker 1 pauses 2 s right after its
    # restore (still starting: no step yet) and is stopped during the pause.
    allowance = harness.startup_allowance_s
    monkeypatch.setattr(supervisor, "STARTUP_ALLOWANCE_S", allowance)
    bound = phase_bound_s(Phase.STARTING, HANG_TIMEOUT_S)
    assert bound == HANG_TIMEOUT_S + allowance
    config, spec = harness.setup(dataset)
    logs = LogCapture()
    outside = Outside(harness, _log_has(logs, "sleep fires in worker 1 entering phase starting"), 1, signal.SIGSTOP)
    outcome, calls, logs = harness.run(spec, config, outside, logs=logs,
                                        fault="sleep:worker=1:phase=starting:seconds=2")
    _assert_complete(outcome, spec, restarts=1)
    (_, story), = calls
    assert story.startswith("hang: worker 1 (stopped) made no progress"), story
    assert story.endswith("no checkpoint yet: started again at step 0 of 30"), story
    if "bound" in story:  # the watchdog fenced it (not TensorFlow's collective timing out first)
        assert (f"before its first step, starting (bound {bound:.0f} s = train.hang_timeout_s {HANG_TIMEOUT_S:g} s + "
                f"{allowance:.0f} s startup") in story
    detected_after = logs.first_time("[supervisor] restart 1/") - outside.sent_at
    assert detected_after <= bound + 15.0, detected_after


def test_non_chief_sigstopped_after_the_result_is_ended_not_fenced(harness, dataset, monkeypatch):
    # Outside. Worker 1 pauses 3 s at its result point; once the chief's result.json is written it is stopped.
    # Nothing is fenced after the chief's result: the supervisor waits its shutdown grace, then ends worker 1.
    # The grace (30 s in production, here min(30, the 15 s finishing bound)) is shortened to 8 s for this test only,
    # still longer than the 3 s pause: the path is the same, the wait 7 s shorter.
    monkeypatch.setattr(supervisor, "SHUTDOWN_GRACE_S", 8.0)
    config, spec = harness.setup(dataset)
    logs = LogCapture()
    result_path = os.path.join(spec.run_dir, RESULT_NAME)

    def result_written_while_worker_1_finishes() -> bool:
        return "sleep fires in worker 1 entering phase result" in logs.text and os.path.exists(result_path)

    outside = Outside(harness, result_written_while_worker_1_finishes, 1, signal.SIGSTOP)
    outcome, calls, logs = harness.run(spec, config, outside, logs=logs,
                                        fault="sleep:worker=1:phase=result:seconds=3")
    ended_after = time.monotonic() - outside.sent_at
    assert calls == [] and outcome.num_attempts == 1
    _assert_complete(outcome, spec, restarts=0)
    grace = min(supervisor.SHUTDOWN_GRACE_S, phase_bound_s(Phase.FINISHING, HANG_TIMEOUT_S))
    assert grace - 1.0 <= ended_after <= grace + 10.0, ended_after
