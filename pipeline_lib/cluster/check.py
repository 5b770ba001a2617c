"""`validate_cluster`: the configured strategy checked against this machine's devices and TF_CONFIG."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from pipeline_lib.cluster.info import ClusterInfo, cluster_from_env
from pipeline_lib.cluster.probe import (
    package_versions,
    relevant_env,
    tf_build_info,
    visible_devices,
    visible_gpus,
)
from pipeline_lib.cluster.report import (
    ClusterConfigError,
    ClusterReport,
    Finding,
    error,
    format_findings,
    warning,
)
from pipeline_lib.cluster.tf_config import LOCAL_STRATEGIES, check_tf_config
from pipeline_lib.config import PipelineConfig, Strategy

logger = logging.getLogger(__name__)

TPU_ADDRESS_ENV = ("TPU_NAME", "TPU_ADDRESS", "COLAB_TPU_ADDR", "TPU_WORKER_HOSTNAMES")


def _device_findings(config: PipelineConfig, devices: dict[str, tuple[str, ...]], environ: Mapping[str, str],
                     cluster: ClusterInfo | None) -> list[Finding]:
    train = config.train
    kind = train.strategy
    num_gpus = len(devices.get("GPU", ()))
    found: list[Finding] = []
    if kind in (Strategy.ONE_DEVICE, Strategy.MIRRORED) and num_gpus == 0 and not train.cpu_replicas:
        found.append(error("no_gpu_for_strategy", f"train.strategy {kind.value!r} asks for GPUs but this machine "
                                                  "has none visible (CUDA_VISIBLE_DEVICES="
                                                  f"{environ.get('CUDA_VISIBLE_DEVICES', '<unset>')!r}); set "
                                                  "train.cpu_replicas (e.g. 2) to use logical CPU devices, or "
                                                  "train.strategy: auto"))
    if kind == Strategy.MIRRORED and train.cpu_replicas and num_gpus:
        found.append(warning("cpu_replicas_with_gpus", f"train.cpu_replicas ({train.cpu_replicas}) mirrors over CPU "
                                                       f"devices although {num_gpus} GPU(s) are visible; unset "
                                                       "train.cpu_replicas to train on the GPUs"))
    if kind == Strategy.TPU and not devices.get("TPU") and not any(environ.get(n) for n in TPU_ADDRESS_ENV):
        found.append(error("no_tpu", "train.strategy 'tpu' but no TPU device is visible and none of "
                                     f"{', '.join(TPU_ADDRESS_ENV)} is set; run on a TPU VM, set TPU_NAME to the "
                                     "TPU's name or grpc:// address, or choose another strategy"))
    if cluster is None:
        if kind == Strategy.PARAMETER_SERVER and train.parameter_servers < 1:
            found.append(error("no_parameter_servers", "train.strategy 'parameter_server' without TF_CONFIG needs "
                                                       "train.parameter_servers ≥ 1 so the launcher starts them "
                                                       "(train.parameter_servers is 0); set it, or choose another "
                                                       "strategy"))
        if kind == Strategy.MULTI_WORKER_MIRRORED and train.workers == 1:
            found.append(warning("multi_worker_single_worker", "train.strategy 'multi_worker_mirrored' with "
                                                               "train.workers 1 and no TF_CONFIG trains as a single "
                                                               "worker; set train.workers or use 'auto'"))
        return found
    if train.uses_parameter_server(cluster.has_ps):
        counts = {"worker": (len(cluster.cluster.get("worker", ())), train.workers, "train.workers"),
                  "ps": (len(cluster.cluster.get("ps", ())), train.parameter_servers, "train.parameter_servers")}
    elif kind not in LOCAL_STRATEGIES:
        counts = {"chief+worker": (cluster.num_workers, train.workers, "train.workers")}
    else:
        counts = {}
    for job, (listed, configured, key) in counts.items():
        if listed != configured:
            found.append(error("workers_mismatch", f"TF_CONFIG of {cluster.name} lists {listed} {job} task(s) but "
                                                   f"{key} is {configured} in the config; set {key}: {listed} so "
                                                   "the shard plan covers every task"))
    return found


def validate_cluster(config: PipelineConfig, environ: Mapping[str, str] | None = None) -> ClusterReport:
    """Check the configured strategy against this machine and TF_CONFIG, and report what is there.

    Only physical devices are listed, so TensorFlow's runtime is not initialised and
    `tf.config.set_logical_device_configuration` still works afterwards in this process.

    Args:
        config: the pipeline config (`train.strategy`, `train.cpu_replicas`, `train.workers`...).
        environ: the environment to read TF_CONFIG and TF_*/XLA_FLAGS from; default os.environ.

    Returns:
        The ClusterReport, warnings included.

    Raises:
        ClusterConfigError: when any finding is an error; the message lists them all and
            `error.report` holds the report.
    """
    environ = os.environ if environ is None else environ
    text = environ.get("TF_CONFIG", "").strip()
    findings: list[Finding] = []
    cluster = None
    if text:
        findings += check_tf_config(text, config.train.strategy, "TF_CONFIG")
        if not any(f.level == "error" for f in findings):
            cluster = cluster_from_env({"TF_CONFIG": text})
    devices = visible_devices()
    if not text or cluster is not None:
        findings += _device_findings(config, devices, environ, cluster)
    report = ClusterReport(
        strategy=config.train.strategy.value,
        tf_config_set=bool(text),
        task=cluster.name if cluster is not None else None,
        cluster=dict(cluster.cluster) if cluster is not None else {},
        num_workers=cluster.num_workers if cluster is not None else config.train.workers,
        versions=package_versions(),
        tf_build=tf_build_info(),
        devices=devices,
        gpus=visible_gpus(environ),
        env=relevant_env(environ),
        findings=tuple(findings),
    )
    for finding in report.warnings:
        logger.warning("cluster check [%s]: %s", finding.rule, finding.message)
    if report.errors:
        raise ClusterConfigError(format_findings(findings, "the cluster check"), findings, report)
    logger.info("cluster check passed: strategy %s, %d GPU(s), TF_CONFIG %s", report.strategy, len(report.gpus),
                "set" if text else "not set")
    return report
