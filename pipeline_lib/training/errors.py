"""The training errors: training cannot start or go on, or it stopped on request."""

from __future__ import annotations

from pipeline_lib.core.errors import TfdagError


class TrainingError(TfdagError, RuntimeError):
    """Training cannot start or go on; the message names the value, where it came from and the fix."""


class TrainingInterrupted(TfdagError, RuntimeError):
    """A stop was requested (preemption): a checkpoint of `step` was saved; resume from it."""

    def __init__(self, step: int, checkpoint_path: str | None = None):
        super().__init__(f"training stopped at step {step} on request; checkpoint {checkpoint_path} saved")
        self.step = step
        self.checkpoint_path = checkpoint_path
