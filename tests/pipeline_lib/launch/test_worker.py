"""The worker entry point: SIGTERM as a stop request, server tasks, exit codes of a real process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import weakref

import pytest

from pipeline_lib.cluster.info import ClusterInfo
from pipeline_lib.launch import worker
from pipeline_lib.launch.heartbeat import Heartbeat, read_heartbeat
from pipeline_lib.launch.spec import PREEMPTION_EXIT_CODE, WorkerSpec
from pipeline_lib.launch.worker import WorkerHooks
from pipeline_lib.training.hooks import Phase, TrainHooks
from pipeline_lib.training.results import TrainResult
from tests.pipeline_lib.launch_support import (
    REPO_ROOT,
    make_config,
    make_spec,
    plan_for,
    write_dataset_on_disk,
)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return write_dataset_on_disk(str(tmp_path_factory.mktemp("worker_data")), num_train=256, num_eval=64)


def test_a_worker_process_keeps_its_input_iterator_to_its_exit_and_training_in_process_releases_it():
    class Iterator:  # stands for the distributed iterator; only its lifetime matters here
        pass

    kept, released = Iterator(), Iterator()
    WorkerHooks(heartbeat=None).input_done(kept)
    WorkerHooks(heartbeat=None, stop=threading.Event()).input_done(released)
    kept_ref, released_ref = weakref.ref(kept), weakref.ref(released)
    del kept, released
    try:
        assert kept_ref() is not None and released_ref() is None
    finally:
        worker._KEPT_UNTIL_EXIT.clear()


def test_sigterm_becomes_a_stop_request():
    hooks = WorkerHooks(heartbeat=None)
    previous = signal.getsignal(signal.SIGTERM)
    try:
        hooks.install_sigterm()
        assert not hooks.stop_requested()
        os.kill(os.getpid(), signal.SIGTERM)
        assert hooks.stop_requested()
    finally:
        signal.signal(signal.SIGTERM, previous)


class _Faults(TrainHooks):
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def on_restored(self, step: int) -> None:
        self.calls.append((Phase.STARTING.value, step))

    def on_step_end(self, step: int, examples: int, loss: float) -> None:
        self.calls.append(("step", step))

    def on_phase(self, phase: Phase, step: int) -> None:
        self.calls.append((phase.value, step))


def test_step_hooks_beat_with_the_phase_and_call_the_faults(tmp_path):
    cluster = ClusterInfo(task_type="worker", task_index=1, cluster={"worker": ("a:1", "b:2")})
    faults = _Faults()
    hooks = WorkerHooks(Heartbeat(str(tmp_path), cluster, interval_s=3600), extra=[faults])
    path = str(tmp_path / "worker-1.json")
    hooks.on_restored(0)
    assert read_heartbeat(path)["phase"] == "starting" and read_heartbeat(path)["start_step"] == 0
    hooks.on_phase(Phase.STEPPING, 0)
    hooks.on_step_end(1, 32, 0.5)
    hooks.on_step_end(2, 32, 0.4)
    assert read_heartbeat(path)["step"] == 1  # step 1 forced, step 2 throttled
    hooks.on_phase(Phase.FINISHING, 2)  # a phase change is always written
    beat = read_heartbeat(path)
    assert beat["phase"] == "finishing" and beat["step"] == 2
    assert faults.calls == [("starting", 0), ("stepping", 0), ("step", 1), ("step", 2), ("finishing", 2)]


def test_fault_injection_loads_test_support_only_when_tfdag_fault_is_set(tmp_path, monkeypatch, dataset):
    config = make_config(str(tmp_path))
    spec = make_spec(config, dataset, plan_for(dataset, config, steps=4), str(tmp_path / "run"))
    for name in ("pipeline_lib.testing", "pipeline_lib.testing.faults", "pipeline_lib.testing.worker_support"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    for name in worker.TEST_SUPPORT_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert worker._load_test_support() is None
    assert "pipeline_lib.testing.worker_support" not in sys.modules and "pipeline_lib.testing.faults" not in sys.modules

    def fault_hooks() -> WorkerHooks:
        additions = worker._load_test_support()(spec, config, ClusterInfo(), dataset)
        return WorkerHooks(None, extra=additions.hooks, before_result=additions.before_result)

    monkeypatch.setenv("TFDAG_FAULT", "raise:worker=1:step=3")
    assert fault_hooks().extra == ()  # worker 0: not its fault
    monkeypatch.setenv("TFDAG_FAULT", "raise:worker=0:step=3")
    hooks = fault_hooks()
    hooks.on_step_end(2, 32, 0.5)
    with pytest.raises(sys.modules["pipeline_lib.testing.faults"].FaultInjected, match="raise:worker=0:step=3"):
        hooks.on_step_end(3, 32, 0.5)


def test_server_tasks_only_under_parameter_server(tmp_path):
    ps_config = make_config(str(tmp_path), strategy="parameter_server", workers=2, parameter_servers=1)
    cluster = {"chief": ("h:1",), "worker": ("h:2", "h:3"), "ps": ("h:4",)}
    assert worker.is_server_task(ps_config, ClusterInfo(task_type="ps", task_index=0, cluster=cluster))
    assert worker.is_server_task(ps_config, ClusterInfo(task_type="worker", task_index=1, cluster=cluster))
    assert not worker.is_server_task(ps_config, ClusterInfo(task_type="chief", task_index=0, cluster=cluster))
    mwms = make_config(str(tmp_path), workers=2)
    assert not worker.is_server_task(mwms, ClusterInfo(task_type="worker", task_index=1,
                                                       cluster={"worker": ("h:1", "h:2")}))


def test_a_bad_spec_prints_the_traceback_and_exits_1(tmp_path, capsys):
    code = worker.worker_main(["--spec", str(tmp_path / "missing.json")])
    assert code == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "missing.json" in err


def _run_worker(spec: WorkerSpec, tmp_path, env: dict | None = None) -> subprocess.CompletedProcess:
    path = tmp_path / "spec.json"
    path.write_text(spec.model_dump_json())
    environ = {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG", *worker.TEST_SUPPORT_VARIABLES)}
    environ.update(env or {})
    return subprocess.run([sys.executable, "-m", "pipeline_lib.launch.worker", "--spec", str(path)], cwd=REPO_ROOT,
                          env=environ, capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.slow
def test_single_worker_process_trains_and_writes_result(tmp_path, dataset):
    config = make_config(str(tmp_path))
    run_dir = str(tmp_path / "run")
    spec = make_spec(config, dataset, plan_for(dataset, config, steps=12), run_dir)
    done = _run_worker(spec, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    result = TrainResult.model_validate_json((tmp_path / "run" / "result.json").read_text())
    assert result.final_step == 12 and result.is_chief and result.start_step == 0
    assert [c.step for c in result.checkpoints] == [10, 12]
    beat = read_heartbeat(os.path.join(spec.heartbeat_dir, "worker-0.json"))
    assert beat["step"] == 12 and beat["examples"] == 12 * 32 and beat["phase"] == "finishing"
    assert beat["start_step"] == 0


@pytest.mark.slow
def test_sigterm_checkpoints_and_exits_with_the_preemption_code(tmp_path, dataset):
    config = make_config(str(tmp_path), checkpoint_every_steps=100)
    run_dir = str(tmp_path / "run")
    spec = make_spec(config, dataset, plan_for(dataset, config, steps=30), run_dir)
    done = _run_worker(spec, tmp_path, env={"TFDAG_FAULT": "term:worker=0:step=7"})
    assert done.returncode == PREEMPTION_EXIT_CODE, done.stderr[-3000:]
    assert "preempted at step 7" in done.stdout
    manifest = json.loads((tmp_path / "run" / "checkpoints" / "ckpt-7.manifest.json").read_text())
    assert manifest["step"] == 7
    assert not (tmp_path / "run" / "result.json").exists()
