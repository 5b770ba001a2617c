"""What a worker's caller adds to a training task (`WorkerAdditions`), apart from the worker entry that applies them,
so that test support (`pipeline_lib.testing.worker_support`) builds them without importing the entry."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from pipeline_lib.cluster.fingerprint import Fingerprint
from pipeline_lib.cluster.info import ClusterInfo
from pipeline_lib.config import PipelineConfig
from pipeline_lib.data.manifest import Manifest
from pipeline_lib.launch.spec import WorkerSpec
from pipeline_lib.training.hooks import TrainHooks


@dataclasses.dataclass(frozen=True)
class WorkerAdditions:
    """What a worker's caller adds to one training task beyond its config and spec.

    Attributes:
        hooks: more training-loop hooks, each called after the worker's own (heartbeat, metrics, stop request).
        before_result: each called with the final step once training returned (the final checkpoint saved) and
            before the chief writes its result.
        fingerprint_fn: applied to this task's preflight fingerprint before it is written (`run_preflight`).
    """

    hooks: tuple[TrainHooks, ...] = ()
    before_result: tuple[Callable[[int], None], ...] = ()
    fingerprint_fn: Callable[[Fingerprint], Fingerprint] | None = None


NO_ADDITIONS = WorkerAdditions()
# Builds a task's additions once its spec, config, cluster and manifest are known (before the preflight).
AdditionsFn = Callable[[WorkerSpec, PipelineConfig, ClusterInfo, Manifest], WorkerAdditions]


def is_server_task(config: PipelineConfig, cluster: ClusterInfo) -> bool:
    """ps and worker tasks of a parameter-server cluster serve; they do not run the training loop."""
    return config.train.uses_parameter_server(cluster.has_ps) and cluster.has_ps and cluster.task_type in ("ps", "worker")
