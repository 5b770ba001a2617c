"""Early stopping (`train.early_stopping`) as the loop's action: the patience rule of `training.early_stopping`."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from pipeline_lib.checkpoints.records import CheckpointRecord
from pipeline_lib.training.actions.base import LoopAction
from pipeline_lib.training.agreement import GroupStop
from pipeline_lib.training.early_stopping import EarlyStop, EarlyStopping

logger = logging.getLogger(__name__)


class StopEarly(LoopAction):
    """The chief's patience rule observes each evaluation and, after a checkpoint, calls for a stop once its patience
    ran out. A restored run replays the evaluation its checkpoint's state predates, so it stops where an
    uninterrupted run does; one restored where early stopping had ended it trains nothing."""

    def __init__(self, early_stopping: EarlyStopping):
        self.early_stopping = early_stopping

    def on_start(self, step: int, restored: CheckpointRecord | None) -> EarlyStop | None:
        self.early_stopping.replay(restored)
        stop = self.early_stopping.outcome()
        if stop is not None:
            logger.info("resumed at step %d, where early stopping had ended training: %s", step, stop.reason)
        return stop

    def on_evaluation(self, step: int, metrics: Mapping[str, float]) -> None:
        self.early_stopping.observe(step, metrics)

    def stop_outcome(self) -> EarlyStop | None:
        return self.early_stopping.outcome()

    def describe_stop(self, agreed: GroupStop) -> str | None:
        """A worker other than the chief: the chief's early stop in words, from the best step and value agreed."""
        return None if agreed.pruned else self.early_stopping.describe(agreed.best_step, agreed.best_value)
