"""The distributed state of one process: TF_CONFIG parsed once into a frozen ClusterInfo value."""

from __future__ import annotations

import json
import os

from pydantic import BaseModel, ConfigDict

WORKER_JOBS = ("chief", "worker")


class ClusterInfo(BaseModel):
    """Task type and index of this process plus the cluster it belongs to.

    A process without TF_CONFIG is a single worker that is its own chief.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    task_type: str = "worker"
    task_index: int = 0
    cluster: dict[str, tuple[str, ...]] = {}

    @property
    def num_workers(self) -> int:
        """Training workers: the chief plus the workers (parameter servers and evaluators excluded)."""
        count = sum(len(self.cluster.get(job, ())) for job in WORKER_JOBS)
        return max(count, 1)

    @property
    def worker_index(self) -> int:
        """Index among the training workers, the chief first."""
        if self.task_type == "chief":
            return 0
        if self.task_type == "worker":
            return len(self.cluster.get("chief", ())) + self.task_index
        return -1

    @property
    def is_chief(self) -> bool:
        if self.task_type == "chief":
            return True
        return self.task_type == "worker" and self.task_index == 0 and not self.cluster.get("chief")

    @property
    def has_ps(self) -> bool:
        return bool(self.cluster.get("ps"))

    @property
    def name(self) -> str:
        """'worker 1', 'chief 0', 'ps 0': how logs and errors name this task."""
        return f"{self.task_type} {self.task_index}"

    def to_tf_config(self) -> str:
        return json.dumps({"cluster": {k: list(v) for k, v in self.cluster.items()},
                           "task": {"type": self.task_type, "index": self.task_index}})


def cluster_from_env(environ: dict[str, str] | None = None) -> ClusterInfo:
    """Parse TF_CONFIG from the environment (already validated by the cluster rules)."""
    text = (environ if environ is not None else os.environ).get("TF_CONFIG", "").strip()
    if not text:
        return ClusterInfo()
    data = json.loads(text)
    task = data.get("task", {})
    return ClusterInfo(
        task_type=task.get("type", "worker"),
        task_index=int(task.get("index", 0)),
        cluster={k: tuple(v) for k, v in data.get("cluster", {}).items()},
    )


def worker_scratch_dir(base_dir: str, cluster: ClusterInfo) -> str:
    """Where this task writes: the real directory for the chief, a private scratch one otherwise.

    TensorFlow's multi-worker checkpoint pattern: every worker must take part in a save,
    but only the chief's copy is kept.
    """
    if cluster.is_chief:
        return base_dir
    return os.path.join(base_dir, ".scratch", f"{cluster.task_type}-{cluster.task_index}")
