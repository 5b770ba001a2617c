"""Tests for pipeline_lib.cluster.preflight: real 2-process preflights over loopback, mismatches, missing and unreachable peers."""

from __future__ import annotations

import importlib.metadata
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline_lib.cluster.info import ClusterInfo
from pipeline_lib.cluster.preflight import run_preflight
from pipeline_lib.cluster.preflight_report import PreflightError, PreflightReport
from pipeline_lib.cluster.probe import GpuInfo
from pipeline_lib.testing.preflight_override import OVERRIDE_ENV
from tests.pipeline_lib.cluster.preflight_support import (
    fake_peer,
    listen_on,
    two_workers,
)

REPO = str(Path(__file__).resolve().parents[3])
TF_VERSION = importlib.metadata.version("tensorflow")

CHILD = """
import json, socket, sys
from pipeline_lib.cluster.info import cluster_from_env
from pipeline_lib.cluster.preflight import run_preflight
from pipeline_lib.cluster.preflight_report import PreflightError
from pipeline_lib.testing.preflight_override import fingerprint_fn_from_env
cluster = cluster_from_env()
try:
    # A skewed node faked as the worker entry fakes one: test support's fingerprint_fn, from the environment.
    report = run_preflight(sys.argv[1], cluster, "config-hash", "data-hash", float(sys.argv[2]),
                           fingerprint_fn=fingerprint_fn_from_env())
except PreflightError as error:
    print(str(error), file=sys.stderr)
    sys.exit(3)
# The listener is closed: a server (TensorFlow's, here a plain socket) can bind the port at once.
port = int(cluster.cluster[cluster.task_type][cluster.task_index].rsplit(":", 1)[1])
with socket.socket() as sock:
    sock.bind(("", port))
print(json.dumps({"passed": report.passed, "tasks": [f.task for f in report.fingerprints],
                  "reachable": report.reachable, "warnings": list(report.warnings)}))
"""


def launch(cluster: ClusterInfo, run_dir: str, timeout_s: float, extra_env: dict | None = None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != OVERRIDE_ENV}
    env.update({"PYTHONPATH": REPO, "TF_CPP_MIN_LOG_LEVEL": "3", "TF_CONFIG": cluster.to_tf_config(),
                **(extra_env or {})})
    return subprocess.Popen([sys.executable, "-c", CHILD, run_dir, str(timeout_s)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(process: subprocess.Popen) -> tuple[int, str, str]:
    out, err = process.communicate(timeout=180)
    return process.returncode, out, err


def test_two_worker_preflight_passes(tmp_path):
    run_dir = str(tmp_path / "run")
    clusters = two_workers()
    results = [finish(p) for p in [launch(c, run_dir, 60) for c in clusters]]
    for (code, out, err), cluster in zip(results, clusters):
        assert code == 0, err[-3000:]
        summary = json.loads(out.strip().splitlines()[-1])
        assert summary["passed"] and summary["tasks"] == ["worker 0", "worker 1"]
        other = clusters[1 - cluster.task_index]
        assert summary["reachable"] == {other.name: other.cluster["worker"][other.task_index]}
    names = set(os.listdir(tmp_path / "run" / "preflight"))
    assert {"worker-0.json", "worker-1.json", "reached-worker-0.json", "reached-worker-1.json", "report.json",
            "report.md"} <= names
    assert not any(n.startswith(("failed-", "conflict-")) for n in names)
    report = PreflightReport.model_validate_json((tmp_path / "run" / "preflight" / "report.json").read_text())
    assert report.passed and report.task == "worker 0"  # the chief (worker 0, no chief job) writes it
    assert {f.versions["tensorflow"] for f in report.fingerprints} == {TF_VERSION}
    assert {f.config_hash for f in report.fingerprints} == {"config-hash"}
    assert "| tensorflow | " + TF_VERSION + " | " + TF_VERSION + " |" in report.to_markdown()


def test_version_skew_fails_both_workers_with_the_diff(tmp_path):
    run_dir = str(tmp_path / "run")
    clusters = two_workers()
    processes = [launch(clusters[0], run_dir, 60),
                 launch(clusters[1], run_dir, 60, {OVERRIDE_ENV: json.dumps({"tensorflow": "2.13.1"})})]
    for code, _out, err in [finish(p) for p in processes]:
        assert code == 3, err[-3000:]
        assert "the 2 tasks of this cluster do not match" in err
        row = next(line for line in err.splitlines() if line.strip().startswith("tensorflow"))
        assert row.split() == ["tensorflow", TF_VERSION, "2.13.1", "worker", "1"]
        assert f"worker 1 has 2.13.1 where worker 0 has {TF_VERSION}" in err
        assert "install the same tensorflow version on every node" in err
    report = json.loads((tmp_path / "run" / "preflight" / "report.json").read_text())
    assert report["passed"] is False and "2.13.1" in report["errors"][0]


# --- in-process peers: a fingerprint file and, where wanted, a plain listener stand in for the other task --------

def test_unreachable_peer_fails_within_the_timeout_naming_it(tmp_path):
    me, peer = two_workers()
    fake_peer(str(tmp_path), peer)  # its fingerprint exists, but nobody listens on its port
    with pytest.raises(PreflightError) as error:
        run_preflight(str(tmp_path), me, "c", "d", timeout_s=2)
    address = peer.cluster["worker"][1]
    assert f"preflight of worker 0: worker 1 at {address} is unreachable within 2 s" in str(error.value)
    assert "check the address in TF_CONFIG" in str(error.value)
    marker = json.loads((tmp_path / "preflight" / "failed-worker-0.json").read_text())
    assert marker["task"] == "worker 0" and "unreachable" in marker["message"]


def test_missing_peer_times_out_naming_it(tmp_path):
    me, _peer = two_workers()
    with pytest.raises(PreflightError) as error:
        run_preflight(str(tmp_path), me, "c", "d", timeout_s=1)
    message = str(error.value)
    assert "preflight of worker 0 timed out after 1 s waiting for worker 1 (its fingerprint" in message
    assert "worker-1.json" in message and "raise preflight.timeout_s" in message
    # this task's own listener was closed on the way out
    port = int(me.cluster["worker"][0].rsplit(":", 1)[1])
    with socket.socket() as sock:
        sock.bind(("", port))


def test_in_process_pass_reports_gpu_differences_as_warnings(tmp_path):
    me, peer = two_workers()
    fake_peer(str(tmp_path), peer, gpus=(GpuInfo(device="/physical_device:GPU:0", name="NVIDIA H200",
                                                 memory_mb=143771),))
    with listen_on(peer):
        report = run_preflight(str(tmp_path), me, "c", "d", timeout_s=10)
    assert report.passed and report.reachable == {"worker 1": peer.cluster["worker"][1]}
    gpu_warnings = [w for w in report.warnings if w.startswith("GPUs differ")]
    assert gpu_warnings and "worker 1 has 1× NVIDIA H200 (143771 MiB)" in gpu_warnings[0]
    assert "| GPUs | none | 1× NVIDIA H200 (143771 MiB) |" in report.to_markdown()


def test_config_data_and_cluster_differences_fail_with_a_table(tmp_path):
    me, peer = two_workers()
    other_cluster = ClusterInfo(task_type="worker", task_index=1,
                                cluster={"worker": (me.cluster["worker"][0], "127.0.0.1:1")})
    fake_peer(str(tmp_path), peer, config_hash="other-config", data_hash="other-data",
              tf_config=other_cluster.to_tf_config())
    with pytest.raises(PreflightError) as error:
        run_preflight(str(tmp_path), me, "c", "d", timeout_s=5)
    lines = str(error.value).splitlines()
    fields = {line.split()[0] for line in lines[2:5]}
    assert fields == {"config_hash", "data_hash", "cluster"}
    assert (f"TF_CONFIG of worker 1 lists cluster.worker ['{me.cluster['worker'][0]}', '127.0.0.1:1'] but the "
            f"others list ['{me.cluster['worker'][0]}', '{me.cluster['worker'][1]}']") in str(error.value)
    assert "every task must run the same pipeline config" in str(error.value)


def test_two_tasks_claiming_one_slot_fail(tmp_path):
    me, peer = two_workers()
    fake_peer(str(tmp_path), me, pid=1)  # another live task on another host already holds worker 0
    with pytest.raises(PreflightError, match=r"two tasks claim worker 0: pid 1 on peer-host and pid \d+ on "):
        run_preflight(str(tmp_path), me, "c", "d", timeout_s=5)
    conflict = json.loads((tmp_path / "preflight" / "conflict-worker-0.json").read_text())
    assert "own task.index" in conflict["message"]
    # the other worker sees the conflict marker and fails too
    with pytest.raises(PreflightError, match=r"two tasks claim worker 0"):
        run_preflight(str(tmp_path), peer, "c", "d", timeout_s=5)


def test_a_peers_failure_stops_this_task(tmp_path):
    me, _peer = two_workers()
    folder = tmp_path / "preflight"
    folder.mkdir()
    (folder / "failed-worker-1.json").write_text(json.dumps({"task": "worker 1", "message": "boom on worker 1"}))
    with pytest.raises(PreflightError, match=r"preflight failed on worker 1, so worker 0 stops too:\nboom on worker 1"):
        run_preflight(str(tmp_path), me, "c", "d", timeout_s=5)


def test_single_process_preflight_writes_its_report(tmp_path):
    report = run_preflight(str(tmp_path), ClusterInfo(), "c", "d", timeout_s=5)
    assert report.passed and [f.task for f in report.fingerprints] == ["worker 0"]
    assert (tmp_path / "preflight" / "report.md").read_text().startswith("# Preflight (passed")
