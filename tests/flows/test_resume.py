"""`tfdag run --resume` from outside, against the session's Prefect server and MLflow servers: one run whose process
group is SIGKILLed mid-training, and whose MLflow server is then stopped during registration, resumed after each,
ends as one run. It trains to its planned final step, has one MLflow run (FINISHED) and one registered version, and
runs no stage again whose output was complete. A finished run resumed does nothing, and a changed config is
refused, naming its keys. A deployment's flow run stopped mid-training and retried with `prefect flow-run retry`
resumes the run it started.

With TFDAG_RESUME_MATRIX=full the run is also killed at every stage boundary before registration, in turn, with the
model check on.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from pipeline_lib.tracking.stage_record import (
    StageRecord,
    StageStatus,
    read_stage_record,
)
from tests.flows.test_pipeline_flow import ROOT, digits_config
from tests.servers import prefect_cli

pytestmark = pytest.mark.slow

FULL = os.environ.get("TFDAG_RESUME_MATRIX") == "full"
# (stage, wait for a checkpoint): the flow's process group is SIGKILLed once the stage record shows the stage running.
KILLS = ((("convert_to_tfrecords", False), ("plan_shards", False), ("train", True), ("consolidate_checkpoints", False),
          ("evaluate", False), ("evaluate_champion", False), ("log_model", False), ("validate_model", False),
          ("gate", False)) if FULL else (("train", True),))
MODEL_NAME = "digits-resume-test"
# What every attempt does again: checks that write nothing (storage, the label, the cluster), reopening the run,
# and, until the gate has decided, the champion's evaluation (the gate compares with the champion of now).
EVERY_ATTEMPT = {"check_storage", "check_label", "validate_cluster", "reopen_tracking_run", "evaluate_champion"}


def _config(tmp_path: Path, mlflow_url: str) -> Path:
    data = digits_config(tmp_path, strategy="default", cpu_replicas=None, isolation="none", epochs=8,
                         checkpoint_every_steps=40, early_stopping={"enabled": False})
    data["name"] = "digits-resume"
    data["tracking"] = {"mlflow_uri": mlflow_url, "experiment": f"resume-{tmp_path.name}",
                        "registered_model": f"{MODEL_NAME}-{tmp_path.name}", "register": "always"}
    data["evaluation"]["validate_model"] = FULL
    path = tmp_path / "digits-resume.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _tfdag(env: dict[str, str], *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "flows.cli", "run", *args, "--json"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _record(runs: Path) -> tuple[Path, StageRecord] | None:
    for run_dir in runs.glob("*") if runs.exists() else ():
        try:
            record = read_stage_record(str(run_dir))
        except ValueError:  # caught mid-rename: read it on the next poll
            continue
        if record is not None:
            return run_dir, record
    return None


def _kill_at(process: subprocess.Popen, runs: Path, stage: str, after_checkpoint: bool) -> str:
    """SIGKILL the process group once `stage` runs (and, with `after_checkpoint`, a checkpoint exists); returns the
    stage the record shows running at the kill."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        assert process.poll() is None, f"the run ended before stage {stage}: {process.stderr.read()[-3000:]}"
        found = _record(runs)
        if found is not None:
            run_dir, record = found
            last = record.stages[-1] if record.stages else None
            names = [s.name for s in record.stages]
            passed = stage in names and (last.name != stage or last.status != StageStatus.RUNNING)
            running = last is not None and last.name == stage and last.status == StageStatus.RUNNING
            # A checkpoint is complete (verified on restore) once its manifest is written, last.
            ready = not after_checkpoint or any((run_dir / "checkpoints").glob("ckpt-*.manifest.json"))
            if (running and ready) or passed:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=60)
                return last.name if last is not None else ""
        time.sleep(0.02)
    raise AssertionError(f"stage {stage} did not start within 300 s")


@pytest.fixture
def own_mlflow(tmp_path):
    """An MLflow server of the test's own (the test stops it and starts it again on its port): its URL, its store and
    a function that restarts it."""
    from flows.stack.processes import stop_process
    from flows.stack.servers import start_mlflow_server
    from pipeline_lib.core.net import free_port

    port, store = free_port(), tmp_path / "mlflow"
    servers = [start_mlflow_server(store, store / "artifacts", port)]

    def stop() -> None:
        stop_process(servers[-1])

    def start() -> None:
        servers.append(start_mlflow_server(store, store / "artifacts", port))

    try:
        yield f"http://127.0.0.1:{port}", stop, start
    finally:
        stop()


def test_a_run_killed_mid_training_then_cut_off_from_mlflow_at_registration_resumes_into_one_run(
        tfdag_stack, prefect_api, own_mlflow, tmp_path):
    """SIGKILLed mid-training (with TFDAG_RESUME_MATRIX=full: at every stage boundary in turn), resumed; then its
    MLflow server stopped once `track` starts: `tfdag run --resume` exits 1 with one line naming the server, well
    within a minute; once the server is back, `--resume` registers the model and finishes the run."""
    from mlflow import MlflowClient
    from prefect.client.orchestration import get_client

    url, stop_mlflow, start_mlflow = own_mlflow
    config = _config(tmp_path, url)
    env = tfdag_stack.cli_env()
    runs = tmp_path / "out" / "runs"
    killed_in = []
    process = _tfdag(env, str(config))
    for stage, after_checkpoint in KILLS:
        killed_in.append(_kill_at(process, runs, stage, after_checkpoint))
        process = _tfdag(env, str(config), "--resume")
    assert "train" in killed_in, killed_in

    deadline = time.monotonic() + 300
    while (found := _record(runs)) is None or found[1].stages[-1].name != "track":
        assert time.monotonic() < deadline and process.poll() is None, "the run did not reach track"
        time.sleep(0.02)
    stop_mlflow()
    stopped = time.monotonic()
    _, err = process.communicate(timeout=300)
    assert process.returncode == 1, err[-3000:]
    assert time.monotonic() - stopped < 60
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"tfdag: failed: TrackingUnreachable: MLflow tracking server {url} did not answer "
                           "(connection refused) when "), err[-3000:]
    assert "finish the run where it stopped with `tfdag run CONFIG --resume`" in last
    assert "Traceback" not in err, err[-3000:]

    # A kept evaluation whose plots are gone (written after the stage returned: `plots.written_after`) runs again.
    (_record(runs)[0] / "evaluation" / "plots" / "roc.png").unlink()
    start_mlflow()
    process = _tfdag(env, str(config), "--resume")
    out, err = process.communicate(timeout=600)
    assert process.returncode == 0, err[-4000:]
    summary = json.loads(out.strip().splitlines()[-1])

    run_dir, record = _record(runs)
    assert [p.name for p in runs.iterdir()] == [run_dir.name] == [summary["run_name"]]
    plan = json.loads((run_dir / "stages" / "plan_shards.json").read_text())
    assert summary["final_step"] == plan["total_steps"]
    train = json.loads((run_dir / "stages" / "train.json").read_text())
    assert train["start_step"] > 0, "training went on from its checkpoint"
    finished = [s.name for s in record.stages if s.status == StageStatus.FINISHED and s.name not in EVERY_ATTEMPT]
    assert finished.count("evaluate") == 2 and (run_dir / "evaluation" / "plots" / "roc.png").is_file()
    finished.remove("evaluate")
    assert len(finished) == len(set(finished)), f"a stage that finished ran again: {finished}"
    names = [s.name for s in record.stages]
    assert names.count("reopen_tracking_run") == len(KILLS) + 1 and names.count("track") == 2
    decided = next(i for i, s in enumerate(record.stages) if s.name == "gate" and s.status == StageStatus.FINISHED)
    assert "evaluate_champion" not in names[decided:], "the champion is not evaluated again once the gate decided"

    client = MlflowClient(tracking_uri=url, registry_uri=url)
    experiment_id = client.get_experiment_by_name(f"resume-{tmp_path.name}").experiment_id
    [run] = client.search_runs([experiment_id])
    assert run.info.run_id == summary["mlflow_run_id"] and run.info.status == "FINISHED"
    assert "tfdag.failed_stage" not in run.data.tags
    assert "evaluation/plots/roc.png" in {a.path for a in client.list_artifacts(run.info.run_id, "evaluation/plots")}
    [version] = client.search_model_versions(f"name = '{MODEL_NAME}-{tmp_path.name}'")
    assert (version.version, version.run_id) == ("1", run.info.run_id) and summary["model_version"] == "1"
    # A model a kill left pending was marked failed and logged again: one READY model, none pending.
    statuses = [str(m.status) for m in client.search_logged_models(experiment_ids=[experiment_id])]
    assert statuses.count("READY") == 1 and "PENDING" not in statuses, statuses
    first_flow_run = run.data.tags["prefect_flow_run_id"]  # the tags of the run's first attempt
    with get_client(sync_client=True) as prefect:
        assert prefect.read_flow_run(first_flow_run).state.is_crashed(), "the killed attempt's flow run is closed"

    # Finished: resumed again, it prints its summary and exits with its code, and writes nothing.
    before = (run_dir / "stages.json").read_bytes()
    again = subprocess.run([sys.executable, "-m", "flows.cli", "run", str(config), "--resume", summary["run_name"],
                            "--json"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads(again.stdout.strip().splitlines()[-1]) == summary
    assert (run_dir / "stages.json").read_bytes() == before

    # A changed config is refused before Prefect starts, naming the keys; a key a resume may change is not one.
    changed = yaml.safe_load(config.read_text())
    changed["train"].update(epochs=9, max_restarts=5)
    changed["evaluation"]["gate"] = {"threshold": 0.5}
    config.write_text(yaml.safe_dump(changed))
    refused = subprocess.run([sys.executable, "-m", "flows.cli", "run", str(config), "--resume"], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=600, check=False)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert (f"tfdag: --resume {summary['run_name']}: the config changed since that run started, at "
            "evaluation.gate.threshold, train.epochs;") in refused.stderr
    assert "tfdag | Prefect" not in refused.stdout


def test_prefect_retry_of_a_deployment_flow_run_stopped_mid_training_resumes_its_run(
        tfdag_stack, prefect_api, mlflow_client, tmp_path):
    """The flow-run process SIGTERMed mid-training ends the flow run Crashed; `prefect flow-run retry ID` runs it
    again under the same id, on the stack's worker, and that attempt resumes the run the first one started."""
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment

    config = _config(tmp_path, tfdag_stack.state.mlflow_url)
    runs = tmp_path / "out" / "runs"
    flow_run = run_deployment("training-pipeline/manual", parameters={"config": str(config)}, timeout=0)
    deadline = time.monotonic() + 300
    while True:
        assert time.monotonic() < deadline, "the deployment's run did not reach training with a checkpoint"
        found = _record(runs)
        if found is not None and found[1].stages and found[1].stages[-1].name == "train" and any(
                (found[0] / "checkpoints").glob("ckpt-*.manifest.json")):
            break
        time.sleep(0.05)
    run_dir, record = found
    assert record.prefect_flow_run_id == str(flow_run.id)
    os.kill(record.pid, signal.SIGTERM)

    def final_state(timeout: float):
        with get_client(sync_client=True) as prefect:
            end = time.monotonic() + timeout
            while time.monotonic() < end:
                state = prefect.read_flow_run(flow_run.id).state
                if state is not None and state.is_final():
                    return state
                time.sleep(0.5)
        raise AssertionError(f"flow run {flow_run.id} did not end within {timeout} s")

    assert final_state(120).is_crashed()
    retried = prefect_cli(tfdag_stack, "flow-run", "retry", str(flow_run.id))
    assert retried.returncode == 0, retried.stdout + retried.stderr
    assert final_state(600).is_completed()

    assert [p.name for p in runs.iterdir()] == [run_dir.name]
    record = read_stage_record(str(run_dir))
    assert record.prefect_flow_run_id == str(flow_run.id) and record.summary is not None
    assert json.loads((run_dir / "stages" / "train.json").read_text())["start_step"] > 0
    names = [s.name for s in record.stages]
    assert names.count("convert_to_tfrecords") == 1 and names.count("reopen_tracking_run") == 1
    [run] = mlflow_client.search_runs([mlflow_client.get_experiment_by_name(f"resume-{tmp_path.name}").experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_id == record.tracking_run_id
