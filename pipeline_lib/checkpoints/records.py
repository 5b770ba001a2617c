"""The record of one saved checkpoint: its step, its path, the eval metrics measured there and, for an elastic run,
where it stands in the data."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

# The train loss of the last step before the save, beside the eval metrics: a run resumed at its final step
# reports it as its final loss.
TRAIN_LOSS_METRIC = "train_loss"
# The manifest key of an elastic run's DataPosition.
DATA_POSITION_KEY = "data_position"


class DataPosition(BaseModel):
    """Where an elastic run (`train.elastic`) stands in its data at a checkpoint, and the sizes that brought it there.

    `records` counts the records of the training stream consumed so far: the epochs' orders one after the other, each
    cut to `epoch_records`; the run resumes at record `records` whatever its next worker count. The attempt's
    worker count, global batch (the configured one, `configured_global_batch`, or the nearest that splits over its
    replicas) and learning rate are recorded beside it.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    records: int
    epoch_records: int
    num_workers: int
    global_batch: int
    configured_global_batch: int
    learning_rate: float


class CheckpointRecord(BaseModel):
    """One checkpoint: its global step, its prefix and the eval metrics measured at that step."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    step: int
    path: str  # checkpoint prefix, e.g. <run_dir>/checkpoints/ckpt-300
    metrics: dict[str, float] = {}  # eval metrics measured at this step (eval_loss, eval_accuracy...), train_loss
    data_position: DataPosition | None = None  # an elastic run's; None for any other run

    @classmethod
    def from_manifest(cls, prefix: str, manifest: dict[str, Any]) -> CheckpointRecord:
        """The record of the checkpoint at `prefix`, read from its integrity manifest."""
        position = manifest.get(DATA_POSITION_KEY)
        return cls(step=int(manifest["step"]), path=prefix,
                   metrics={k: float(v) for k, v in manifest.get("metrics", {}).items()},
                   data_position=DataPosition.model_validate(position) if position is not None else None)
