"""What training reports: the TrainResult every worker returns, with the launcher's restart story."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from pipeline_lib.checkpoints.records import CheckpointRecord


class RestartRecord(BaseModel):
    """One restart of the whole group: its number (1-based), why, when (UNIX time), and the step it resumed from.

    `resumed_step` is what the restarted group's chief restored (0: no checkpoint yet), None when that group
    failed before it restored.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    number: int
    cause: str
    time: float
    delay_s: float
    total_steps: int
    resumed_step: int | None = None

    @property
    def story(self) -> str:
        """The cause and where the restart resumed: `worker 0 killed by SIGKILL; resumed at step 20 of 40`."""
        if self.resumed_step is None:
            return f"{self.cause}; the restarted group failed before it restored a checkpoint"
        if self.resumed_step == 0:
            return f"{self.cause}; no checkpoint yet: started again at step 0 of {self.total_steps}"
        if self.resumed_step == self.total_steps:
            return (f"{self.cause}; resumed at step {self.resumed_step} of {self.total_steps}, the final step: "
                    "nothing left to train, the result comes from its checkpoint")
        return f"{self.cause}; resumed at step {self.resumed_step} of {self.total_steps}"

    def describe(self) -> str:
        return f"restart {self.number}: {self.story}"


class ResizeRecord(BaseModel):
    """One resize of an elastic run's group (`train.elastic`): from and to how many training workers, why, and the
    step the resized group resumed from (its chief restored it; None when that group failed before it did)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    number: int
    from_workers: int
    to_workers: int
    reason: str
    time: float
    step: int | None = None

    @property
    def story(self) -> str:
        """`3 → 2 workers at step 1200: <reason>`."""
        where = f"at step {self.step}" if self.step is not None else "before the resized group restored"
        return f"{self.from_workers} → {self.to_workers} workers {where}: {self.reason}"

    def describe(self) -> str:
        return f"resize {self.number}: {self.story}"

    def summary(self) -> dict:
        """`{"from": 3, "to": 2, "step": 1200, "reason": "..."}`: the run summary's form."""
        return {"from": self.from_workers, "to": self.to_workers, "step": self.step, "reason": self.reason}


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
    restarts: tuple[RestartRecord, ...] = ()  # filled in by the launcher
    resizes: tuple[ResizeRecord, ...] = ()  # an elastic run's resizes, filled in by the launcher
    examples_per_sec: float = 0.0
    wall_s: float = 0.0
    start_step: int = 0  # the step restored from a checkpoint (0 for a fresh run)
    is_chief: bool = True
    # Early stopping (`train.early_stopping`): the checkpoint metric it watched (None when disabled); whether it
    # ended training and at which step (final_step); its best evaluation's step (None before any); why training
    # ended, in words (an early stop, a tuning trial's pruner, or the planned steps).
    early_stopping_metric: str | None = None
    stopped_early: bool = False
    stopped_at_step: int | None = None
    best_step: int | None = None
    stop_reason: str = ""
    # A tuning trial's pruner ended training (`tuning.pruning`) at stopped_at_step: not an early stop (stopped_early
    # stays False); best_step is then the best evaluation of the tuned metric.
    pruned: bool = False
