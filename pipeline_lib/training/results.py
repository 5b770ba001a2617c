"""What training reports: the TrainResult every worker returns."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from pipeline_lib.checkpoints.records import CheckpointRecord


class TrainResult(BaseModel):
    """What the chief reports after training."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    run_dir: str
    strategy: str  # the Strategy value actually used
    strategy_reason: str
    num_workers: int
    num_replicas: int  # num_replicas_in_sync over all workers
    per_replica_batch_size: int
    global_batch_size: int
    base_learning_rate: float
    scaled_learning_rate: float
    lr_scaling: str
    steps_per_epoch: int
    total_steps: int
    final_step: int
    final_loss: float
    checkpoint_dir: str
    checkpoints: tuple[CheckpointRecord, ...]
    tensorboard_dir: str
    num_restarts: int = 0
    examples_per_sec: float = 0.0
    wall_s: float = 0.0
    start_step: int = 0  # the step restored from a checkpoint (0 for a fresh run)
    is_chief: bool = True
