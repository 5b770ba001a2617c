"""The record of one saved checkpoint: its step, its path and the eval metrics measured there."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

# The train loss of the last step before the save, beside the eval metrics: a run resumed at its final step
# reports it as its final loss.
TRAIN_LOSS_METRIC = "train_loss"


class CheckpointRecord(BaseModel):
    """One checkpoint: its global step, its prefix and the eval metrics measured at that step."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    step: int
    path: str  # checkpoint prefix, e.g. <run_dir>/checkpoints/ckpt-300
    metrics: dict[str, float] = {}  # eval metrics measured at this step (eval_loss, eval_accuracy...), train_loss

    @classmethod
    def from_manifest(cls, prefix: str, manifest: dict[str, Any]) -> CheckpointRecord:
        """The record of the checkpoint at `prefix`, read from its integrity manifest."""
        return cls(step=int(manifest["step"]), path=prefix,
                   metrics={k: float(v) for k, v in manifest.get("metrics", {}).items()})
