"""The stop the whole group agrees on between executions: a stop requested on any worker (preemption), or the
chief's early stop, in one all-reduce, so that every worker leaves at the same step."""

from __future__ import annotations

import dataclasses
import math

import tensorflow as tf

from pipeline_lib.training import strategy as strategies
from pipeline_lib.training.early_stopping import EarlyStop
from pipeline_lib.training.hooks import TrainHooks


@dataclasses.dataclass(frozen=True)
class GroupStop:
    """What the group agreed after an execution.

    `requested`: some worker was asked to stop (a preemption notice): save, then leave to be restarted.
    `early`: the chief's early stopping ended training, with its best step and value (the same on every worker);
    `pruned`: that stop came from a tuning trial's pruner.
    """

    requested: bool = False
    early: bool = False
    best_step: int = -1
    best_value: float = math.nan
    pruned: bool = False


class StopAgreement:
    """Called between executions on every worker with this worker's early stop (only the chief's can be set).

    With one worker (or under parameter_server, where the chief alone runs the loop) nothing is exchanged. With
    several, one all-reduce carries every worker's stop request and the chief's early stop, best step and value.
    """

    def __init__(self, choice: strategies.StrategyChoice, hooks: TrainHooks, *, collective: bool = True):
        self.choice, self.hooks = choice, hooks
        self.collective = collective and choice.num_workers > 1
        self._reduce = None

    def __call__(self, early: EarlyStop | None) -> GroupStop:
        requested = bool(self.hooks.stop_requested())
        if not self.collective:
            if early is None:
                return GroupStop(requested)
            return GroupStop(requested, True, early.best_step, early.best_value, early.pruned)
        local = [1.0 if requested else 0.0, 0.0, 0.0, 0.0, 0.0]
        if early is not None:
            local[1:] = [1.0, float(early.best_step), early.best_value, 1.0 if early.pruned else 0.0]
        # float32: a best step is exact up to 2**24 (16.7 million steps); the value is only shown.
        agreed = self._all_reduce(tf.constant(local, tf.float32)).numpy()
        if agreed[1] <= 0.5:
            return GroupStop(bool(agreed[0] > 0.5))
        return GroupStop(bool(agreed[0] > 0.5), True, round(float(agreed[2])), float(agreed[3]), bool(agreed[4] > 0.5))

    def _all_reduce(self, local: tf.Tensor) -> tf.Tensor:
        if self._reduce is None:
            strategy = self.choice.strategy

            def replica_values(values):
                # Flags from every replica (summed, then compared with 0.5); the early stop's step, value and
                # pruned flag from the first replica alone (the chief's), so that the sum is the chief's value.
                is_first = tf.equal(tf.distribute.get_replica_context().replica_id_in_sync_group, 0)
                return tf.concat([values[:2], tf.where(is_first, values[2:], tf.zeros_like(values[2:]))], axis=0)

            @tf.function
            def reduce(values):
                per_replica = strategy.run(replica_values, args=(values,))
                return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

            self._reduce = reduce
        return self._reduce(local)
