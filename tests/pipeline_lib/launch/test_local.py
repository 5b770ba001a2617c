"""The launcher with real worker processes, real signals and real checkpoints over loopback (the supervisor through it)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from pipeline_lib.checkpoints import manifests as checkpoints
from pipeline_lib.cluster.info import ClusterInfo
from pipeline_lib.launch import supervisor
from pipeline_lib.launch.errors import LaunchTimeout, RestartsExhausted, WorkerFailed
from pipeline_lib.launch.local import launch, plan_tasks
from tests.pipeline_lib.launch_support import (
    REPO_ROOT,
    LogCapture,
    assert_no_orphans,
    make_config,
    make_spec,
    plan_for,
)


@pytest.fixture(autouse=True)
def no_orphans():
    yield
    assert_no_orphans()


def _setup(tmp_path, dataset, *, steps: int, **train):
    config = make_config(str(tmp_path), **train)
    run_dir = str(tmp_path / "run")
    spec = make_spec(config, dataset, plan_for(dataset, config, steps=steps), run_dir)
    return config, spec, run_dir


def _restarts():
    calls: list[tuple[int, str]] = []
    return calls, lambda n, cause: calls.append((n, cause))


# --- pure parts --------------------------------------------------------------------------------------------------

def test_task_layouts(tmp_path):
    single = plan_tasks(make_config(str(tmp_path)))
    assert [t.name for t in single] == ["worker 0"] and not single[0].env_tf_config
    mwms = plan_tasks(make_config(str(tmp_path), workers=3))
    assert [t.name for t in mwms] == ["worker 0", "worker 1", "worker 2"]
    addresses = mwms[0].cluster.cluster["worker"]
    assert len(set(addresses)) == 3 and all(a.startswith("127.0.0.1:") for a in addresses)
    assert mwms[0].cluster.is_chief and all(t.is_trainer for t in mwms)
    ps = plan_tasks(make_config(str(tmp_path), strategy="parameter_server", workers=2, parameter_servers=1))
    assert [t.name for t in ps] == ["chief 0", "worker 0", "worker 1", "ps 0"]
    assert [t.is_trainer for t in ps] == [True, False, False, False]
    assert ps[3].cluster == ClusterInfo(task_type="ps", task_index=0, cluster=ps[0].cluster.cluster)


# --- real processes ----------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_two_workers_succeed_with_prefixed_logs_and_the_chiefs_result(tmp_path, dataset):
    # With the cross-worker preflight and MLflow on: only the chief logs to the run created beforehand.
    import mlflow

    tracking_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = mlflow.MlflowClient(tracking_uri)
    run_id = client.create_run(client.create_experiment("launch-test")).info.run_id
    config = make_config(str(tmp_path), preflight=True, tracking={"enabled": True, "mlflow_uri": tracking_uri},
                         workers=2, per_replica_batch_size=16)
    run_dir = str(tmp_path / "run")
    spec = make_spec(config, dataset, plan_for(dataset, config, steps=20), run_dir)
    spec = spec.model_copy(update={"mlflow_run_id": run_id})
    logs = LogCapture()
    progress = []
    outcome = launch(spec, config, log_fn=logs, on_progress=progress.append)
    result = outcome.result
    assert result.final_step == 20 and result.total_steps == 20 and result.num_workers == 2
    # The chief's progress, from its heartbeat: never past the end, never backwards.
    assert progress and all(p.total_steps == 20 and 0 <= p.step <= 20 for p in progress)
    assert [p.step for p in progress] == sorted(p.step for p in progress)
    assert result.strategy == "multi_worker_mirrored" and result.is_chief and result.num_restarts == 0
    assert outcome.restarts == () and outcome.num_attempts == 1
    assert [c.step for c in result.checkpoints] == [10, 20]
    lines = [line for _, line in logs.lines]
    assert any(line.startswith("[worker 0] ") for line in lines)
    assert any(line.startswith("[worker 1] ") for line in lines)
    # The chief alone prints the progress line.
    assert any(line.startswith("[worker 0] ") and "train | step:     20" in line for line in lines)
    assert not any(line.startswith("[worker 1] ") and "train | step:" in line for line in lines)
    assert os.path.isdir(os.path.join(run_dir, "preflight"))
    assert [m.step for m in client.get_metric_history(run_id, "loss")] == [10, 20]
    # Every line of every task is kept in <run_dir>/logs/<task>.log.
    for task in ("worker-0", "worker-1"):
        with open(os.path.join(run_dir, "logs", f"{task}.log")) as handle:
            kept = handle.read()
        assert kept.startswith("--- attempt 1 ---\n") and f"{task.replace('-', ' ')} finished at step 20" in kept


@pytest.mark.slow
def test_a_worker_exception_is_permanent_with_its_index_and_traceback(tmp_path, dataset):
    config, spec, _ = _setup(tmp_path, dataset, steps=40, workers=2, per_replica_batch_size=16)
    calls, on_restart = _restarts()
    with pytest.raises(WorkerFailed) as error:
        launch(spec, config, log_fn=LogCapture(), on_restart=on_restart, env={"TFDAG_FAULT": "raise:worker=1:step=5"})
    message = str(error.value)
    assert error.value.task == "worker 1" and error.value.exit_code == 1
    assert message.startswith("worker 1 exited 1 (a Python exception)")
    assert "Traceback (most recent call last)" in message and "FaultInjected" in message
    assert calls == []  # permanent: no restart
    # The failed task's traceback survives its process in the run's logs.
    with open(os.path.join(spec.run_dir, "logs", "worker-1.log")) as handle:
        kept = handle.read()
    assert "Traceback (most recent call last)" in kept and "FaultInjected" in kept


@pytest.mark.slow
def test_sigkill_of_the_chief_mid_epoch_restarts_and_finishes_exactly_total_steps(tmp_path, dataset):
    # 512 rows / global batch 32: 16 steps per epoch; killed at step 23 of epoch 2, checkpoint at 20.
    config, spec, _ = _setup(tmp_path, dataset, steps=40, workers=2, per_replica_batch_size=16)
    calls, on_restart = _restarts()
    logs = LogCapture()
    outcome = launch(spec, config, log_fn=logs, on_restart=on_restart, env={"TFDAG_FAULT": "kill:worker=0:step=23"})
    # One story per restart: its cause and the step it resumed from, told once the group has restored.
    assert calls == [(1, "worker 0 killed by SIGKILL; resumed at step 20 of 40")]
    assert [r.cause for r in outcome.restarts] == ["worker 0 killed by SIGKILL"] and outcome.num_attempts == 2
    result = outcome.result
    assert result.start_step == 20 and result.final_step == 40 and result.num_restarts == 1
    assert [r.resumed_step for r in result.restarts] == [20]
    assert "resuming at step 20 of 40" in logs.text
    assert "[supervisor] restart 1: worker 0 killed by SIGKILL; resumed at step 20 of 40" in logs.text
    with open(os.path.join(spec.run_dir, "logs", "worker-0.log")) as handle:
        kept = handle.read()
    assert "--- attempt 1 ---" in kept and "--- attempt 2 ---" in kept and "resuming at step 20 of 40" in kept


# A SIGSTOP while stepping and a SIGTERM preemption are cases of the fault matrix (test_fault_matrix.py:
# `test_non_chief_sigstopped_while_stepping_is_caught_as_a_hang`, which also bounds the detection time, and
# `test_non_chief_preempted_in_its_last_10_steps`, which asserts the step both workers agreed on and the resume from
# it; the chief's preemption runs with TFDAG_FAULT_MATRIX=full). The matrix's kill of the chief mid-checkpoint is
# `test_chief_killed_during_a_save_leaves_the_previous_checkpoint_latest` below (with 2 workers).


@pytest.mark.slow
def test_a_corrupt_latest_checkpoint_falls_back_to_the_previous_one(tmp_path, dataset):
    config, spec, run_dir = _setup(tmp_path, dataset, steps=20)
    first = launch(spec, config, log_fn=LogCapture())
    assert [c.step for c in first.result.checkpoints] == [10, 20]
    data_file = next(p for p in os.listdir(os.path.join(run_dir, "checkpoints")) if p.startswith("ckpt-20.data"))
    path = os.path.join(run_dir, "checkpoints", data_file)
    with open(path, "r+b") as handle:
        byte = handle.read(1)
        handle.seek(0)
        handle.write(bytes([byte[0] ^ 0xFF]))
    longer = spec.model_copy(update={"plan": plan_for(dataset, config, steps=30)})
    logs = LogCapture()
    second = launch(longer, config, log_fn=logs)
    assert "ckpt-20 is not valid" in logs.text and "falling back to the previous one" in logs.text
    assert second.result.start_step == 10 and second.result.final_step == 30


@pytest.mark.slow
def test_chief_killed_during_a_save_leaves_the_previous_checkpoint_latest(tmp_path, dataset):
    # Two workers, as the fault matrix runs them (its mid-checkpoint case is a duplicate of this one): the chief is
    # killed inside its step-20 save, after the data and index, before the manifest that commits it.
    config, spec, run_dir = _setup(tmp_path, dataset, steps=30, max_restarts=0, workers=2, per_replica_batch_size=16)
    checkpoint_dir = os.path.join(run_dir, "checkpoints")
    with pytest.raises(RestartsExhausted) as error:
        launch(spec, config, log_fn=LogCapture(), env={"TFDAG_FAULT": "kill_during_save:worker=0:step=20"})
    assert error.value.cause == "worker 0 killed by SIGKILL"
    names = os.listdir(checkpoint_dir)
    assert "ckpt-20.index" in names and "ckpt-20.manifest.json" not in names  # data written, never committed
    assert checkpoints.latest_valid(checkpoint_dir).step == 10
    logs = LogCapture()
    resumed = launch(spec, config, log_fn=logs)  # the fault fired once per run: not again
    assert resumed.result.start_step == 10 and resumed.result.final_step == 30
    assert [c.step for c in resumed.result.checkpoints] == [10, 20, 30]


@pytest.mark.slow
def test_restarts_exhausted_names_the_last_cause(tmp_path, dataset):
    # Attempt 1 is killed at step 5; attempt 2 hangs at step 8; max_restarts 1 leaves no third attempt.
    config, spec, _ = _setup(tmp_path, dataset, steps=40, max_restarts=1, hang_timeout_s=3.0,
                             restart_backoff_s=0.2, checkpoint_every_steps=100)
    calls, on_restart = _restarts()
    with pytest.raises(RestartsExhausted) as error:
        launch(spec, config, log_fn=LogCapture(), on_restart=on_restart,
               env={"TFDAG_FAULT": "kill:worker=0:step=5,stop:worker=0:step=8"})
    assert calls == [(1, "worker 0 killed by SIGKILL; no checkpoint yet: started again at step 0 of 40")]
    assert error.value.cause.startswith("hang: worker 0 (stopped) made no progress")
    message = str(error.value)
    assert "train.max_restarts (1) is used up" in message and "Last cause: hang: worker 0 (stopped)" in message


@pytest.mark.slow
def test_the_overall_timeout_ends_every_worker(tmp_path, dataset):
    config, spec, _ = _setup(tmp_path, dataset, steps=100_000, checkpoint_every_steps=100_000, log_every_steps=1000)
    with pytest.raises(LaunchTimeout, match=r"train.timeout_s"):
        launch(spec, config, log_fn=LogCapture(), timeout_s=10)


@pytest.mark.slow
def test_ctrl_c_to_the_launcher_leaves_no_orphan(tmp_path, dataset):
    _, spec, _ = _setup(tmp_path, dataset, steps=100_000, workers=2, per_replica_batch_size=16,
                        checkpoint_every_steps=100_000, log_every_steps=1000)
    spec_path = tmp_path / "launch_spec.json"
    spec_path.write_text(spec.model_dump_json())
    # A shell without job control starts background commands with SIGINT ignored, and children inherit that
    # (`make test &` in a script): restore Python's handler, as an interactive terminal gives the launcher.
    script = textwrap.dedent(f"""
        import signal
        signal.signal(signal.SIGINT, signal.default_int_handler)
        from pipeline_lib.launch.local import launch
        from pipeline_lib.launch.spec import load_spec
        spec = load_spec({str(spec_path)!r})
        try:
            launch(spec, spec.pipeline_config(), log_fn=lambda line: None)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
            raise SystemExit(130)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    try:
        # Both workers past their first step: each has been forked, renamed and placed by then (a heartbeat is
        # first written at start-up, before its peer need exist).
        deadline = time.monotonic() + 240
        while not _both_stepping(spec.heartbeat_dir) and time.monotonic() < deadline and parent.poll() is None:
            time.sleep(0.2)
        assert _both_stepping(spec.heartbeat_dir), "the workers never started stepping"
        started = psutil.Process(parent.pid).children(recursive=True)  # the workers and their fork server
        workers = [p for p in started if "pipeline_lib.launch.worker" in " ".join(p.cmdline())]
        assert len(workers) == 2, [p.cmdline() for p in started]
        parent.send_signal(signal.SIGINT)
        out, _ = parent.communicate(timeout=60)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
    assert parent.returncode == 130 and "interrupted" in out
    _, alive = psutil.wait_procs(started, timeout=10)
    assert alive == [], f"orphans: {[(p.pid, p.cmdline()) for p in alive]}"


def _both_stepping(heartbeat_dir: str) -> bool:
    """Whether worker-0 and worker-1 have each written a heartbeat past step 0."""
    for task in ("worker-0", "worker-1"):
        try:
            with open(os.path.join(heartbeat_dir, f"{task}.json")) as handle:
                if json.load(handle)["step"] < 1:
                    return False
        except (OSError, ValueError):
            return False
    return True


def test_launcher_module_does_not_import_tensorflow():
    code = "import sys, pipeline_lib.launch.local; print('tensorflow' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                         check=False)
    assert out.stdout.strip() == "False", out.stderr
    assert supervisor.STARTUP_ALLOWANCE_S == 120.0
