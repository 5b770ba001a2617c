"""What one task reports about itself for the preflight: versions, TF build, GPUs, masked env, hashes, TF_CONFIG."""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict

from pipeline_lib.cluster.info import ClusterInfo
from pipeline_lib.cluster.probe import (
    GpuInfo,
    package_versions,
    relevant_env,
    tf_build_info,
    visible_gpus,
)

COMPARED_VERSIONS = ("python", "tensorflow", "keras", "protobuf", "numpy", "tfdag")


class Fingerprint(BaseModel):
    """What one task reports about itself; every task of a cluster must agree on the compared fields."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    task_type: str
    task_index: int
    host: str
    pid: int
    nonce: str
    written_at: float
    versions: dict[str, str]
    tf_build: dict[str, str]
    gpus: tuple[GpuInfo, ...] = ()
    env: dict[str, str] = {}  # TF_*, XLA_FLAGS, CUDA_VISIBLE_DEVICES; secrets masked
    config_hash: str
    data_hash: str
    tf_config: str

    @property
    def task(self) -> str:
        return f"{self.task_type} {self.task_index}"

    @property
    def slot(self) -> str:
        """'worker-1': how the preflight's file names name this task."""
        return f"{self.task_type}-{self.task_index}"

    @property
    def cluster(self) -> dict[str, list[str]]:
        data = json.loads(self.tf_config) if self.tf_config else {}
        return {job: list(addresses) for job, addresses in sorted(data.get("cluster", {}).items())}


def collect_fingerprint(cluster: ClusterInfo, config_hash: str, data_hash: str,
                        environ: Mapping[str, str] | None = None) -> Fingerprint:
    """This process's fingerprint, as found.

    Args:
        cluster: this task's cluster value.
        config_hash: `PipelineConfig.config_hash()` of the run.
        data_hash: `Manifest.content_hash()` of the dataset.
        environ: the environment (default os.environ): env report, CUDA_VISIBLE_DEVICES.
    """
    environ = os.environ if environ is None else environ
    return Fingerprint(
        task_type=cluster.task_type,
        task_index=cluster.task_index,
        host=socket.gethostname(),
        pid=os.getpid(),
        nonce=uuid.uuid4().hex,
        written_at=time.time(),
        versions=package_versions(COMPARED_VERSIONS[1:]),
        tf_build=tf_build_info(),
        gpus=visible_gpus(environ),
        env=relevant_env(environ),
        config_hash=config_hash,
        data_hash=data_hash,
        tf_config=cluster.to_tf_config() if cluster.cluster else "",
    )
