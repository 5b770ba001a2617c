"""Tests for pipeline_lib.cluster.validate_command: `tfdag validate-cluster`, static rules and with peers."""

from __future__ import annotations

import io
import json

from pipeline_lib.cluster.info import ClusterInfo
from pipeline_lib.cluster.validate_command import run_validate_cluster
from tests.pipeline_lib.cluster.preflight_support import (
    fake_peer,
    listen_on,
    two_workers,
)


def test_validate_cluster_cli_static_rules(tmp_path):
    good = ClusterInfo(task_type="worker", task_index=0, cluster={"worker": ("h:1", "h:2")}).to_tf_config()
    out = io.StringIO()
    assert run_validate_cluster(good, "multi_worker_mirrored", False, None, 5, out, environ={}) == 0
    assert "--tf-config: valid for strategy 'multi_worker_mirrored'" in out.getvalue()

    path = tmp_path / "tf_config.json"
    path.write_text(json.dumps({"cluster": {"worker": ["h:1", "h:1"]}, "task": {"type": "worker", "index": 3}}))
    out = io.StringIO()
    assert run_validate_cluster(str(path), "multi_worker_mirrored", False, None, 5, out, environ={}) == 1
    text = out.getvalue()
    assert f"error [duplicate_address]: {path} of worker 3: cluster.worker[1] and cluster.worker[0]" in text
    assert "error [task_index_out_of_range]" in text and "2 error(s)" in text

    url = json.dumps({"cluster": {"worker": ["grpc://h:1", "h:2"]}, "task": {"type": "worker", "index": 1}})
    out = io.StringIO()
    assert run_validate_cluster(url, "multi_worker_mirrored", False, None, 5, out, environ={}) == 1
    assert ("error [address_not_host_port]: --tf-config of worker 1: cluster.worker[0] 'grpc://h:1' starts with the "
            "URL scheme 'grpc://'; TF_CONFIG takes a bare host:port, e.g. 'h:1'") in out.getvalue()

    out = io.StringIO()
    assert run_validate_cluster(None, "multi_worker_mirrored", False, None, 5, out, environ={"TF_CONFIG": good}) == 0
    assert run_validate_cluster(None, "mirrored", False, None, 5, io.StringIO(), environ={"TF_CONFIG": good}) == 0
    out = io.StringIO()
    assert run_validate_cluster(None, "multi_worker_mirrored", False, None, 5, out, environ={}) == 2
    assert "TF_CONFIG is not set and --tf-config was not given" in out.getvalue()
    out = io.StringIO()
    assert run_validate_cluster(good, "mwms", False, None, 5, out, environ={}) == 2
    assert "--strategy ('mwms') is not a strategy" in out.getvalue()
    out = io.StringIO()
    assert run_validate_cluster(good, "multi_worker_mirrored", True, None, 5, out, environ={}) == 2
    assert "--peers needs --run-dir" in out.getvalue()


def test_validate_cluster_cli_runs_the_preflight_with_peers(tmp_path):
    me, peer = two_workers()
    run_dir = str(tmp_path / "validate-cluster")
    fake_peer(run_dir, peer, config_hash="", data_hash="")  # validate-cluster compares empty hashes
    out = io.StringIO()
    with listen_on(peer):
        code = run_validate_cluster(me.to_tf_config(), "multi_worker_mirrored", True, str(tmp_path), 10, out,
                                    environ={})
    assert code == 0, out.getvalue()
    assert "preflight passed: 2 task(s) match and every peer is reachable" in out.getvalue()
    out = io.StringIO()
    assert run_validate_cluster(me.to_tf_config(), "multi_worker_mirrored", True, str(tmp_path / "other"), 1, out,
                                environ={}) == 1
    assert "timed out after 1 s waiting for worker 1" in out.getvalue()
