"""Shard planning: FILE vs DATA autosharding, files balanced over workers, equal steps per epoch."""

from __future__ import annotations

import enum

from pydantic import BaseModel, ConfigDict

from pipeline_lib.manifest import Manifest


class AutoShardPolicy(str, enum.Enum):
    FILE = "file"  # each worker reads only its own files
    DATA = "data"  # every worker reads every file and keeps its 1/N slice


class WorkerAssignment(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    worker_index: int
    files: tuple[str, ...]  # shard paths relative to the dataset directory
    num_records: int  # records this worker sees per epoch


class ShardPlan(BaseModel):
    """How the train split is spread over the workers, and how many steps each one runs."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    policy: AutoShardPolicy
    num_workers: int
    replicas_per_worker: int
    per_replica_batch_size: int
    global_batch_size: int
    steps_per_epoch: int  # identical on every worker
    epochs: int
    total_steps: int
    assignments: tuple[WorkerAssignment, ...]
    imbalance_ratio: float  # max / mean records per worker (1.0 is perfect)
    warnings: tuple[str, ...] = ()

    def files_for(self, worker_index: int) -> tuple[str, ...]:
        return self.assignments[worker_index].files
