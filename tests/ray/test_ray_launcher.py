"""The Ray launcher on a real Ray cluster (tests/ray/conftest.py): placement on distinct nodes, digits learnt with
data and run dir on moto's S3, clear errors before any actor, and nothing of a run left on the cluster."""

from __future__ import annotations

import contextvars
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from pipeline_lib.cluster.ray_connect import RayClusterError, connect
from pipeline_lib.config import RAY_ADDRESS_ENV, ConfigError
from pipeline_lib.core.net import free_port
from pipeline_lib.data.manifest import Manifest
from pipeline_lib.launch.errors import WorkerFailed
from pipeline_lib.launch.ray_launcher import launch_on_ray
from tests.pipeline_lib.launch_support import (
    REPO_ROOT,
    LogCapture,
    make_config,
    make_spec,
    plan_for,
    write_digits_dataset,
)
from tests.ray.conftest import RAY_IP, WORKER_NODE
from tests.stores.conftest import BUCKET

DIGITS_MODEL = {"factory": "mlp", "params": {"hidden_units": [64]}}


def _digits_on_s3(s3, tmp_path, prefix: str) -> Manifest:
    """The digits dataset written locally, then uploaded with its manifest: the workers read it only from S3."""
    local = write_digits_dataset(str(tmp_path / "digits"))
    uri = f"s3://{BUCKET}/{prefix}/data"
    for shard in local.shards:
        s3.fs.put_file(os.path.join(local.dataset_uri, shard.path), f"{uri.removeprefix('s3://')}/{shard.path}")
    manifest = local.model_copy(update={"dataset_uri": uri})
    s3.fs.pipe_file(f"{uri.removeprefix('s3://')}/manifest.json", manifest.to_json().encode())
    return manifest


def _ray_config(cluster, root: str, **train):
    ray = {"address": cluster.address, "node_ip_address": RAY_IP, "resources_per_worker": {"CPU": 1},
           "placement_timeout_s": 30}
    ray.update(train.pop("ray", {}))
    settings = {"strategy": "multi_worker_mirrored", "workers": 2, "hang_timeout_s": 60.0}
    settings.update(train)
    return make_config(root, label="target", model=DIGITS_MODEL, launcher="ray", ray=ray, **settings)


def _all_actor_ids(cluster) -> set[str]:
    from ray.util.state import list_actors

    return {a.actor_id for a in list_actors(address=cluster.dashboard_url, limit=1000)}


def _nothing_left(cluster) -> None:
    assert cluster.alive_actors() == []
    assert cluster.live_placement_groups() == []


def test_two_worker_mwms_lands_on_two_ray_nodes_and_learns_digits_from_s3(ray_cluster, s3, tmp_path):
    from ray.util.state import list_actors

    dataset = _digits_on_s3(s3, tmp_path, "a")
    root = f"s3://{BUCKET}/a/out"
    config = _ray_config(ray_cluster, root, per_replica_batch_size=32, base_learning_rate=0.005, lr_scaling="none",
                         shuffle=True, checkpoint_every_steps=100, log_every_steps=50, preflight=True)
    spec = make_spec(config, dataset, plan_for(dataset, config, steps=300), f"{root}/run")
    before = _all_actor_ids(ray_cluster)
    logs = LogCapture()
    outcome = launch_on_ray(spec, config, log_fn=logs)
    result = outcome.result
    assert result.final_step == 300 and result.num_workers == 2 and outcome.restarts == ()
    assert result.checkpoints[-1].metrics["eval_accuracy"] >= 0.95, result.checkpoints[-1].metrics
    # One actor per task, on two distinct Ray nodes (by node id), each with its worker's log prefix.
    actors = [a for a in list_actors(address=ray_cluster.dashboard_url, limit=1000) if a.actor_id not in before]
    nodes = {a.name.rsplit("-", 1)[-1]: a.node_id for a in actors if a.class_name == "TaskRunner"}
    assert sorted(nodes) == ["worker 0", "worker 1"] and nodes["worker 0"] != nodes["worker 1"]
    assert any(line.startswith(f"[worker 1 @ {RAY_IP}] ") for _, line in logs.lines)
    assert any(line.startswith(f"[worker 0 @ {RAY_IP}] ") and "train | step:" in line for _, line in logs.lines)
    # Only the chief wrote; everything is on S3 (no shared file system): checkpoints, result, preflight report.
    keys = s3.keys("a/out/run")
    assert "a/out/run/result.json" in keys and any("/checkpoints/" in k or "ckpt" in k for k in keys)
    assert not any(".scratch" in k and k.endswith(".index") for k in keys if "/checkpoints/" in k)
    _nothing_left(ray_cluster)


def test_no_address_anywhere_names_both_places(monkeypatch, tmp_path, ray_cluster):
    monkeypatch.delenv(RAY_ADDRESS_ENV, raising=False)
    config = _ray_config(ray_cluster, str(tmp_path), ray={"address": None})
    with pytest.raises(ConfigError, match="neither train.ray.address nor the RAY_ADDRESS environment variable"):
        connect(config.train.ray)


def test_a_wrong_address_is_named_before_any_actor(ray_cluster, tmp_path):
    import ray

    before = _all_actor_ids(ray_cluster)
    wrong = f"{RAY_IP}:{free_port(RAY_IP)}"
    ray.shutdown()
    try:
        with pytest.raises(RayClusterError) as error:
            connect(_ray_config(ray_cluster, str(tmp_path), ray={"address": wrong}).train.ray)
        assert f"train.ray.address (or RAY_ADDRESS) {wrong!r}: no Ray cluster answers there" in str(error.value)
    finally:
        ray.init(address=ray_cluster.address, _node_ip_address=RAY_IP, log_to_driver=False, configure_logging=False)
    assert _all_actor_ids(ray_cluster) == before


@pytest.mark.parametrize("train, expected", [
    ({"workers": 4}, ("train.ray.placement 'spread' puts each of the 4 task(s) on its own node, but the Ray "
                      "cluster has 3 node(s)")),
    ({"ray": {"resources_per_worker": {"CPU": 1, "GPU": 1}}},
     "asks each task for GPU: 1, but no node of the Ray cluster has that much"),
    ({"ray": {"resources_per_worker": {"CPU": 1, "tpu_slice": 2}}}, "asks each task for tpu_slice: 2"),
])
def test_what_the_cluster_cannot_hold_is_named_before_any_actor_starts(ray_cluster, tmp_path, train, expected):
    dataset = write_digits_dataset(str(tmp_path / "digits"))
    config = _ray_config(ray_cluster, str(tmp_path), **train)
    spec = make_spec(config, dataset, plan_for(dataset, config, steps=10), str(tmp_path / "run"))
    before = _all_actor_ids(ray_cluster)
    with pytest.raises(RayClusterError) as error:
        launch_on_ray(spec, config, log_fn=LogCapture())
    assert expected in str(error.value)
    assert _all_actor_ids(ray_cluster) == before
    _nothing_left(ray_cluster)


def test_a_python_exception_is_permanent_with_task_node_and_traceback_and_leaves_nothing(ray_cluster, s3, tmp_path):
    dataset = _digits_on_s3(s3, tmp_path, "c")
    root = f"s3://{BUCKET}/c/out"
    config = _ray_config(ray_cluster, root, checkpoint_every_steps=10)
    spec = make_spec(config, dataset, plan_for(dataset, config, steps=60), f"{root}/run")
    with pytest.raises(WorkerFailed) as error:
        launch_on_ray(spec, config, log_fn=LogCapture(), env={"TFDAG_FAULT": "raise:worker=1:step=10"})
    message = str(error.value)
    assert error.value.task == "worker 1"
    assert f"worker 1 exited 1 (a Python exception) on node {RAY_IP} (Ray node " in message
    assert "FaultInjected" in message and "Traceback" in message
    _nothing_left(ray_cluster)


@pytest.mark.slow
def test_a_stopped_worker_process_is_fenced_and_restarted(ray_cluster, s3, tmp_path):
    # The Ray fault matrix's "non-chief SIGSTOPped while stepping" runs only with TFDAG_RAY_FAULT_MATRIX=full: this
    # test checks the same hang seen through the actor's heartbeat, its bound, its story and the resume.
    dataset = _digits_on_s3(s3, tmp_path, "d")
    root = f"s3://{BUCKET}/d/out"
    hang_timeout_s = 8.0
    config = _ray_config(ray_cluster, root, checkpoint_every_steps=10, hang_timeout_s=hang_timeout_s)
    spec = make_spec(config, dataset, plan_for(dataset, config, steps=30), f"{root}/run")
    logs, calls = LogCapture(), []
    outcome = launch_on_ray(spec, config, log_fn=logs, on_restart=lambda n, story: calls.append((n, story)),
                            env={"TFDAG_FAULT": "stop:worker=1:step=15"})
    assert outcome.result.final_step == 30 and outcome.result.num_restarts == 1
    assert len(outcome.restarts) == 1 and outcome.restarts[0].cause.startswith("hang: worker 1 (stopped)")
    assert outcome.restarts[0].resumed_step == 10
    (number, story), = calls
    assert number == 1 and story.startswith("hang: worker 1 (stopped) made no progress"), story
    assert story.endswith("resumed at step 10 of 30"), story
    assert "[supervisor] restart 1/3" in logs.text
    # Fenced within the stepping bound and a margin, counted from the fault's line (which reaches this log through
    # the actor, so no earlier than the stop itself).
    detected_after = logs.first_time("[supervisor] restart 1/") - logs.first_time("stop fires in worker 1")
    assert detected_after <= hang_timeout_s + 10.0, detected_after
    _nothing_left(ray_cluster)


@pytest.mark.slow
def test_cancelling_the_driver_mid_training_leaves_no_actor_and_no_placement_group(ray_cluster, s3, tmp_path):
    dataset = _digits_on_s3(s3, tmp_path, "cancel")
    root = f"s3://{BUCKET}/cancel/out"
    config = _ray_config(ray_cluster, root, checkpoint_every_steps=50, log_every_steps=5)
    spec = make_spec(config, dataset, plan_for(dataset, config, steps=2000), f"{root}/run")
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(spec.model_dump_json())
    # A separate driver process, as a Prefect flow run is: SIGTERM is what Prefect's cancellation sends it.
    script = textwrap.dedent(f"""
        from pipeline_lib.launch.ray_launcher import launch_on_ray
        from pipeline_lib.launch.spec import load_spec
        spec = load_spec({str(spec_path)!r})
        try:
            launch_on_ray(spec, spec.pipeline_config(), log_fn=lambda line: print(line, flush=True))
        except KeyboardInterrupt:
            print("interrupted", flush=True)
    """)
    driver = subprocess.Popen([sys.executable, "-c", script], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "PYTHONPATH": REPO_ROOT, "TF_CPP_MIN_LOG_LEVEL": "2"})
    lines = []
    deadline = time.monotonic() + 240
    for line in driver.stdout:
        lines.append(line)
        if "train | step:" in line and "step:     5 " not in line:
            break
        assert time.monotonic() < deadline, "".join(lines[-30:])
    assert driver.poll() is None, "the driver ended before training:\n" + "".join(lines[-40:])
    assert len(ray_cluster.alive_actors()) == 2 and len(ray_cluster.live_placement_groups()) == 1
    driver.send_signal(signal.SIGTERM)
    rest, _ = driver.communicate(timeout=60)
    assert "interrupted" in rest, "".join(lines[-20:]) + rest[-3000:]
    _nothing_left(ray_cluster)


@pytest.mark.slow
def test_parameter_servers_on_ray_two_workers_one_ps_learn_digits(ray_cluster, s3, tmp_path):
    dataset = _digits_on_s3(s3, tmp_path, "ps")
    root = f"s3://{BUCKET}/ps/out"
    config = _ray_config(ray_cluster, root, strategy="parameter_server", workers=2, parameter_servers=1,
                         per_replica_batch_size=32, base_learning_rate=0.005, lr_scaling="none", shuffle=True,
                         checkpoint_every_steps=150, log_every_steps=50, hang_timeout_s=120.0,
                         ray={"placement": "pack", "resources_per_worker": {"CPU": 0.5}})
    spec = make_spec(config, dataset, plan_for(dataset, config, steps=300), f"{root}/run")
    logs = LogCapture()
    result = launch_on_ray(spec, config, log_fn=logs).result
    assert result.strategy == "parameter_server" and result.final_step == 300
    assert any(line.startswith(f"[ps 0 @ {RAY_IP}] ") for _, line in logs.lines)
    assert any(line.startswith(f"[chief 0 @ {RAY_IP}] ") for _, line in logs.lines)
    assert result.checkpoints[-1].metrics["eval_accuracy"] >= 0.9
    _nothing_left(ray_cluster)


@pytest.mark.slow
def test_fifty_deterministic_steps_on_ray_end_with_the_local_launchers_weights(ray_cluster, s3, tmp_path):
    from pipeline_lib.launch.local import launch
    from tests.pipeline_lib.launch_support import (
        max_abs_diff,
        model_weights,
        write_dataset_on_disk,
    )
    from tests.pipeline_lib.training.test_equivalence import (
        EQUIVALENCE,
        MODEL,
        STEPS,
        TOLERANCE,
    )

    local_data = write_dataset_on_disk(str(tmp_path / "data"), num_train=640, num_eval=64)
    settings = {"strategy": "multi_worker_mirrored", "workers": 2, "per_replica_batch_size": 32, **EQUIVALENCE}
    local_config = make_config(str(tmp_path / "local"), model=MODEL, **settings)
    plan = plan_for(local_data, local_config, steps=STEPS)
    local = launch(make_spec(local_config, local_data, plan, str(tmp_path / "local" / "run")), local_config,
                   log_fn=LogCapture()).result
    # The same data, read by the Ray workers from S3 only.
    uri = f"s3://{BUCKET}/equivalence/data"
    for shard in local_data.shards:
        s3.fs.put_file(os.path.join(local_data.dataset_uri, shard.path), f"{uri.removeprefix('s3://')}/{shard.path}")
    remote_data = local_data.model_copy(update={"dataset_uri": uri})
    s3.fs.pipe_file(f"{uri.removeprefix('s3://')}/manifest.json", remote_data.to_json().encode())
    root = f"s3://{BUCKET}/equivalence/out"
    ray_config = make_config(root, model=MODEL, launcher="ray",
                             ray={"address": ray_cluster.address, "node_ip_address": RAY_IP}, **settings)
    on_ray = launch_on_ray(make_spec(ray_config, remote_data, plan, f"{root}/run"), ray_config,
                           log_fn=LogCapture()).result
    assert local.final_step == on_ray.final_step == STEPS and on_ray.checkpoints[-1].step == STEPS
    prefix = on_ray.checkpoints[-1].path
    target = tmp_path / "from_s3"
    target.mkdir()
    for key in s3.fs.glob(f"{prefix.removeprefix('s3://')}*"):
        s3.fs.get_file(key, str(target / os.path.basename(key)))
    ray_weights = model_weights(str(target / os.path.basename(prefix)))
    assert max_abs_diff(model_weights(local.checkpoints[-1].path), ray_weights) <= TOLERANCE


@pytest.mark.slow
def test_sigkill_of_the_raylet_hosting_worker_1_restarts_on_the_survivor_and_a_spare_with_the_restart_in_mlflow(
        ray_cluster, prefect_api, tmp_path):
    # Through the pipeline flow, so the restart is asserted where a user reads it: the summary, MLflow and the Prefect
    # flow run's log. The spare node is added once the first attempt is placed, so it is truly spare: the restart
    # must take the surviving node and the spare, never the lost node (which the GCS still lists alive for a while).
    # The cluster is left as found, 2 worker nodes: the survivor and the spare (the lost node is gone for good).
    from mlflow.tracking import MlflowClient
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    from flows.pipeline import training_pipeline
    from pipeline_lib.config import parse_config
    from tests.flows.test_pipeline_flow import digits_config

    # Long enough that the kill, sent once the chief saved step 20, lands mid-training: 6 epochs (126 steps) ended
    # 1.7 s after step 20's checkpoint, before the lost raylet took its worker down. No early stop shortens it.
    values = digits_config(tmp_path, strategy="multi_worker_mirrored", cpu_replicas=None, workers=2, epochs=20,
                           early_stopping={"enabled": False},
                           checkpoint_every_steps=20, log_every_steps=10, max_restarts=3, launcher="ray",
                           ray={"address": ray_cluster.address, "node_ip_address": RAY_IP, "placement_timeout_s": 90,
                                "resources_per_worker": {"CPU": 1, WORKER_NODE: 1}})
    values["name"] = "digits-ray-raylet"
    config = parse_config(values)
    outcome: dict = {}

    def run():
        try:
            outcome["summary"] = training_pipeline(config)
        except BaseException as error:  # noqa: BLE001 - re-raised in the test thread
            outcome["error"] = error

    # In this test's context: the Prefect settings (the session server's API URL) live in a context variable,
    # which a new thread would not see (its flow would run on an ephemeral server, with its logs there).
    thread = threading.Thread(target=contextvars.copy_context().run, args=(run,))
    thread.start()
    deadline = time.monotonic() + 400
    while len(first_attempt := ray_cluster.alive_actors()) < 2:  # the first attempt is placed
        assert time.monotonic() < deadline and thread.is_alive(), outcome
        time.sleep(0.5)
    node_of_task = {a.name.rsplit("-", 1)[-1]: a.node_id for a in first_attempt}
    lost, survivor = node_of_task["worker 1"], node_of_task["worker 0"]
    spare = ray_cluster.add_node("node_spare")  # while the first attempt starts up
    while not list((tmp_path / "out").rglob("ckpt-20*")):  # the chief saved step 20: training is under way
        assert time.monotonic() < deadline and thread.is_alive(), outcome
        time.sleep(0.5)
    os.kill(ray_cluster.raylet_pid(lost), signal.SIGKILL)
    ray_cluster.forget_node(lost)
    thread.join(timeout=max(deadline + 400 - time.monotonic(), 1))
    assert not thread.is_alive(), "the flow did not end within 800 s"
    if "error" in outcome:
        raise outcome["error"]
    summary = outcome["summary"]
    # Where the later attempts' actors ran, from the GCS's actor table once the flow ended (it keeps ended actors
    # with their node): actors are named <run tag>-<attempt>-<task>.
    run_tag = first_attempt[0].name.split("-")[1]
    hosts_after = {a.node_id for a in ray_cluster.actors(f"tfdag-{run_tag}-") if a.name.split("-")[2] != "1"}

    assert summary.num_restarts >= 1 and summary.blessed, summary
    assert hosts_after == {survivor, spare}, (hosts_after, survivor, spare, lost)  # never the lost node
    client = MlflowClient(tracking_uri=config.mlflow_uri)
    run = client.get_run(summary.mlflow_run_id)
    assert summary.final_step == int(run.data.params["total_steps"])  # exactly the planned steps
    story = run.data.tags["tfdag.restart.1"]
    assert "worker 1" in story and "resumed at step" in story, story
    assert client.get_metric_history(run.info.run_id, "num_restarts")[-1].value == summary.num_restarts
    assert run.info.status == "FINISHED" and int(run.data.params["num_workers"]) == 2
    messages: list[str] = []
    for _ in range(20):
        with get_client(sync_client=True) as prefect:
            logs = prefect.read_logs(log_filter=LogFilter(
                flow_run_id=LogFilterFlowRunId(any_=[run.data.tags["prefect_flow_run_id"]])))
        messages = [log.message for log in logs]
        if any(m.startswith("restart 1 of") for m in messages):
            break
        time.sleep(0.5)
    assert any(m.startswith("restart 1 of") and "worker 1" in m for m in messages), messages[-20:]
    _nothing_left(ray_cluster)

