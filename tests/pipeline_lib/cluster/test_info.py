"""Tests for pipeline_lib.cluster.info: ClusterInfo parsed from TF_CONFIG."""

from __future__ import annotations

from pipeline_lib.cluster.info import ClusterInfo, cluster_from_env
from pipeline_lib.cluster.tf_config import check_tf_config
from tests.pipeline_lib.cluster.tf_config_cases import MWMS, TWO_WORKERS, tf_config


def test_cluster_info_round_trips_through_tf_config():
    info = cluster_from_env({"TF_CONFIG": tf_config(TWO_WORKERS, index=1)})
    assert info == ClusterInfo(task_type="worker", task_index=1, cluster={"worker": ("host-a:2222", "host-b:2222")})
    assert check_tf_config(info.to_tf_config(), MWMS) == []
