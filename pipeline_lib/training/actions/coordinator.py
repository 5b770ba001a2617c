"""The parameter-server coordinator's join before a save, as the chief's loop action."""

from __future__ import annotations

from pipeline_lib.training.actions.base import LoopAction


class JoinCoordinator(LoopAction):
    """Under parameter_server, wait for every step scheduled on the workers before a checkpoint, so the saved
    variables hold all of them (`tf.distribute.coordinator.ClusterCoordinator.join`)."""

    def __init__(self, coordinator):
        self.coordinator = coordinator

    def before_save(self, step: int) -> None:
        self.coordinator.join()
