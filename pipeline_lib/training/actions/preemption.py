"""Save and leave on a stop request: the preemption path (Orbit's `SaveCheckpointIfPreempted`)."""

from __future__ import annotations

from collections.abc import Callable

from pipeline_lib.training.actions.base import LoopAction
from pipeline_lib.training.agreement import GroupStop
from pipeline_lib.training.errors import TrainingInterrupted


class SaveCheckpointIfPreempted(LoopAction):
    """When the group agreed that some worker was asked to stop (a preemption notice: `TrainHooks.stop_requested`),
    save the step every worker reached and raise TrainingInterrupted naming its checkpoint, so the task exits to be
    restarted from it."""

    def after_agreement(self, step: int, agreed: GroupStop, checkpoint: Callable[[], str]) -> None:
        if agreed.requested:
            raise TrainingInterrupted(step, checkpoint())
