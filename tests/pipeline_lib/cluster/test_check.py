"""Tests for pipeline_lib.cluster.check: validate_cluster's single-machine report and its strategy findings."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import tensorflow as tf

from pipeline_lib.cluster.check import validate_cluster
from pipeline_lib.cluster.report import ClusterConfigError, ClusterReport
from pipeline_lib.config import parse_config
from pipeline_lib.core.secrets import MASK
from tests.pipeline_lib.cluster.tf_config_cases import tf_config

REPO = str(Path(__file__).resolve().parents[3])
HAS_GPU = bool(tf.config.list_physical_devices("GPU"))


def make_config(**train):
    return parse_config({"data": {"source": "rows.csv", "label": "y"}, "train": train})


def test_validate_cluster_reports_versions_devices_and_masked_env():
    environ = {"TF_CPP_MIN_LOG_LEVEL": "2", "TF_SERVICE_TOKEN": "abc123", "XLA_FLAGS": "--xla_foo", "PATH": "/bin"}
    report = validate_cluster(make_config(), environ)
    assert isinstance(report, ClusterReport)
    assert report.strategy == "auto" and not report.tf_config_set and report.findings == ()
    assert report.versions["tensorflow"] == tf.__version__
    assert set(report.versions) >= {"python", "tensorflow", "keras", "protobuf", "numpy", "tfdag", "prefect"}
    assert report.devices["CPU"] == tuple(d.name for d in tf.config.list_physical_devices("CPU"))
    assert report.env == {"TF_CPP_MIN_LOG_LEVEL": "2", "TF_SERVICE_TOKEN": MASK, "XLA_FLAGS": "--xla_foo"}
    assert "cuda_version" in report.tf_build
    text = report.to_json()
    assert "abc123" not in text and "abc123" not in report.to_markdown()
    assert ClusterReport.model_validate_json(text) == report
    markdown = report.to_markdown()
    assert f"| tensorflow | {tf.__version__} |" in markdown and "No findings" in markdown


@pytest.mark.skipif(HAS_GPU, reason="needs a machine without GPUs")
@pytest.mark.parametrize("strategy", ["one_device", "mirrored"])
def test_gpu_strategy_without_gpus_is_an_error_unless_cpu_replicas(strategy):
    with pytest.raises(ClusterConfigError) as error:
        validate_cluster(make_config(strategy=strategy), {})
    assert f"train.strategy '{strategy}' asks for GPUs but this machine has none visible" in str(error.value)
    assert "train.cpu_replicas" in str(error.value)
    assert error.value.report is not None and error.value.report.errors[0].rule == "no_gpu_for_strategy"
    assert validate_cluster(make_config(strategy=strategy, cpu_replicas=2), {}).errors == ()


def test_tpu_without_an_address_is_an_error():
    with pytest.raises(ClusterConfigError, match=r"train.strategy 'tpu' but no TPU device is visible and none of "
                                                 r"TPU_NAME"):
        validate_cluster(make_config(strategy="tpu"), {})
    assert validate_cluster(make_config(strategy="tpu"), {"TPU_NAME": "my-tpu"}).errors == ()


def test_parameter_server_without_servers_or_tf_config():
    with pytest.raises(ClusterConfigError, match=r"train.parameter_servers ≥ 1"):
        validate_cluster(make_config(strategy="parameter_server"), {})
    report = validate_cluster(make_config(strategy="multi_worker_mirrored"), {})
    assert [f.rule for f in report.warnings] == ["multi_worker_single_worker"]


def test_tf_config_is_checked_and_must_match_train_workers():
    environ = {"TF_CONFIG": tf_config({"worker": ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]}, index=2)}
    with pytest.raises(ClusterConfigError) as error:
        validate_cluster(make_config(strategy="multi_worker_mirrored", workers=2), environ)
    assert "TF_CONFIG of worker 2 lists 3 chief+worker task(s) but train.workers is 2" in str(error.value)
    report = validate_cluster(make_config(strategy="multi_worker_mirrored", workers=3), environ)
    assert report.tf_config_set and report.task == "worker 2" and report.num_workers == 3
    assert report.cluster["worker"] == ("127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3")
    bad = {"TF_CONFIG": tf_config({"worker": ["127.0.0.1:1"]}, index=4)}
    with pytest.raises(ClusterConfigError, match=r"task_index_out_of_range"):
        validate_cluster(make_config(strategy="multi_worker_mirrored"), bad)


def test_parameter_server_counts_are_compared_per_job():
    cluster = {"chief": ["h:1"], "worker": ["h:2", "h:3"], "ps": ["h:4"]}
    environ = {"TF_CONFIG": tf_config(cluster, task_type="chief")}
    report = validate_cluster(make_config(strategy="parameter_server", workers=2, parameter_servers=1), environ)
    assert report.errors == () and report.task == "chief 0"
    with pytest.raises(ClusterConfigError, match=r"lists 1 ps task\(s\) but train.parameter_servers is 2"):
        validate_cluster(make_config(strategy="parameter_server", workers=2, parameter_servers=2), environ)


def test_validate_cluster_leaves_logical_devices_configurable():
    code = (
        "from pipeline_lib.cluster.check import validate_cluster\n"
        "from pipeline_lib.config import parse_config\n"
        "import tensorflow as tf\n"
        "validate_cluster(parse_config({'data': {'source': 'x.csv', 'label': 'y'}}), {})\n"
        "cpu = tf.config.list_physical_devices('CPU')[0]\n"
        "tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)\n"
        "print(len(tf.config.list_logical_devices('CPU')))\n"
    )
    env = {**os.environ, "PYTHONPATH": REPO, "TF_CPP_MIN_LOG_LEVEL": "3"}
    env.pop("TF_CONFIG", None)
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "2"
