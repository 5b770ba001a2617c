"""The training engine: a custom strategy.run loop over TFRecords under any tf.distribute strategy."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class CheckpointRecord(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    step: int
    path: str  # checkpoint prefix, e.g. <run_dir>/checkpoints/ckpt-300
    metrics: dict[str, float] = {}  # eval metrics measured at this step (eval_loss, eval_accuracy...)


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
