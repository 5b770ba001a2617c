"""Early stopping: the patience rule the chief applies at each evaluation, and its state, kept in every checkpoint.

The chief evaluates at each checkpoint; `EarlyStopping.observe` counts the evaluations at the checkpoint cadence
(`train.checkpoint_every_steps`) since the metric last improved by more than `min_delta`, and `should_stop` turns
True after `patience` of them. An off-cadence save (a preemption's, the last step's) does not count, so a
preempted and resumed run stops where an uninterrupted one does. The whole group leaves at that step through the same agreement as a preemption stop (`agreement`).

The state is variables tracked by the run's `tf.train.Checkpoint`. A checkpoint is written before its evaluation,
so the state it holds is the one before the evaluation at its own step; a restored run replays that evaluation
from the checkpoint's manifest (`observe(record.step, record.metrics)`) and counts on exactly where it was.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping
from typing import Protocol

import tensorflow as tf

from pipeline_lib.checkpoints import selection
from pipeline_lib.checkpoints.records import CheckpointRecord
from pipeline_lib.config import (
    Direction,
    EarlyStoppingConfig,
    PipelineConfig,
    metric_direction,
)

logger = logging.getLogger(__name__)


def early_stopping_metric(config: PipelineConfig) -> tuple[str, Direction]:
    """The checkpoint metric early stopping watches (`eval_<name>`) and the direction in which it improves.

    `train.early_stopping.metric` when set; else the one best-checkpoint selection ranks by (the gate metric as the
    trainer records it), so the best step early stopping reports is the checkpoint `select: best` exports.
    """
    name = config.train.early_stopping.metric
    if name is None:
        return selection.selection_metric(config)
    metric = f"eval_{name.removeprefix('eval_')}"
    return metric, metric_direction(metric, Direction.MAX)  # accuracy rises; loss, mae and rmse fall


class PatienceState(tf.Module):
    """The early-stopping state a checkpoint carries: the value patience counts from (the last one that improved by
    more than `min_delta`) and the evaluations since; the best value and its step (the newest among equals, as
    best-checkpoint selection picks); the step last counted (so an evaluation is never counted twice).

    Plain variables created outside any strategy scope: only the chief updates them; every worker saves and
    restores them with the rest of the checkpoint (the chief's copy is the one kept).
    """

    def __init__(self) -> None:
        super().__init__(name="early_stopping")
        self.reference_value = tf.Variable(math.nan, dtype=tf.float64, trainable=False, name="reference_value")
        self.evaluations_since_improvement = tf.Variable(0, dtype=tf.int64, trainable=False,
                                                         name="evaluations_since_improvement")
        self.best_value = tf.Variable(math.nan, dtype=tf.float64, trainable=False, name="best_value")
        self.best_step = tf.Variable(-1, dtype=tf.int64, trainable=False, name="best_step")
        self.last_evaluated_step = tf.Variable(-1, dtype=tf.int64, trainable=False, name="last_evaluated_step")


@dataclasses.dataclass(frozen=True)
class EarlyStop:
    """Early stopping ended training: the best evaluation's step and value, and why, in words. `pruned`: the stop
    came from a tuning trial's pruner (a `StopRule`), not from patience."""

    best_step: int
    best_value: float
    reason: str
    pruned: bool = False


class StopRule(Protocol):
    """A rule besides patience that the chief applies at each evaluation: a tuning trial's pruner
    (`tuning.pruning`). `observe` sees every evaluation's metrics; `outcome`, asked after an evaluation on the
    checkpoint cadence, is the stop it calls for (an EarlyStop with `pruned` set), which the group agrees on and
    leaves at like an early stop. Only the chief has one; its loop runs it as an action (`actions.pruning`)."""

    def observe(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def outcome(self) -> EarlyStop | None: ...


def improved(value: float, reference: float, direction: Direction, min_delta: float) -> bool:
    """Whether `value` beats `reference` by more than `min_delta` in `direction`; any finite value beats no reference
    (NaN), a NaN or infinite value never beats one."""
    if not math.isfinite(value):
        return False
    if math.isnan(reference):
        return True
    return value < reference - min_delta if direction == Direction.MIN else value > reference + min_delta


def as_good(value: float, best: float, direction: Direction) -> bool:
    """Whether `value` equals or beats `best` in `direction` (any finite value does when there is no best, NaN)."""
    if not math.isfinite(value):
        return False
    return math.isnan(best) or (value <= best if direction == Direction.MIN else value >= best)


class EarlyStopping:
    """The patience rule over the evaluations at the checkpoints, with its state in `state`.

    Args:
        config: `train.early_stopping`.
        metric: the checkpoint metric watched (`early_stopping_metric`).
        direction: the direction in which it improves.
        state: the variables the run's checkpoint tracks.
        every_steps: the evaluation cadence (`train.checkpoint_every_steps`); evaluations off it are not counted.
    """

    def __init__(self, config: EarlyStoppingConfig, metric: str, direction: Direction, state: PatienceState,
                 every_steps: int):
        self.config, self.metric, self.direction, self.state = config, metric, direction, state
        self.every_steps = every_steps
        self._warned_missing = False

    @classmethod
    def for_config(cls, config: PipelineConfig, state: PatienceState) -> EarlyStopping:
        metric, direction = early_stopping_metric(config)
        return cls(config.train.early_stopping, metric, direction, state, config.train.checkpoint_every_steps)

    @property
    def best_step(self) -> int | None:
        step = int(self.state.best_step.numpy())
        return step if step >= 0 else None

    @property
    def best_value(self) -> float:
        return float(self.state.best_value.numpy())

    @property
    def should_stop(self) -> bool:
        """Whether `patience` evaluations in a row have not improved on the best (never when disabled)."""
        return (self.config.enabled and self.best_step is not None
                and int(self.state.evaluations_since_improvement.numpy()) >= self.config.patience)

    def observe(self, step: int, metrics: Mapping[str, float]) -> None:
        """Count the evaluation at `step`: once, and only on the cadence (a step off it, or at or before the last one
        counted, is ignored)."""
        if (not self.config.enabled or step % self.every_steps
                or step <= int(self.state.last_evaluated_step.numpy())):
            return
        value = metrics.get(self.metric)
        if value is None:
            if metrics and not self._warned_missing:  # no metric at all: the run has no eval split
                logger.warning("early stopping watches %s but the evaluation at step %d recorded only %s; it never "
                               "stops this run", self.metric, step, sorted(metrics))
                self._warned_missing = True
            return
        value, state = float(value), self.state
        state.last_evaluated_step.assign(step)
        if improved(value, float(state.reference_value.numpy()), self.direction, self.config.min_delta):
            state.reference_value.assign(value)
            state.evaluations_since_improvement.assign(0)
        else:
            state.evaluations_since_improvement.assign_add(1)
        if as_good(value, self.best_value, self.direction):  # the newest among equals, as selection picks
            state.best_value.assign(value)
            state.best_step.assign(step)

    def replay(self, restored: CheckpointRecord | None) -> None:
        """A restored run: count the evaluation of the restored checkpoint, which its saved state predates."""
        if restored is not None:
            self.observe(restored.step, restored.metrics)

    def outcome(self) -> EarlyStop | None:
        """The stop this state calls for, None while training should go on."""
        if not self.should_stop:
            return None
        best_step = self.best_step
        assert best_step is not None
        return EarlyStop(best_step, self.best_value, self.describe(best_step, self.best_value))

    def describe(self, best_step: int, best_value: float) -> str:
        """Why training stopped early, e.g. `eval_loss did not improve by more than 0 in 5 evaluation(s)
        (train.early_stopping.patience); best 0.2134 at step 40`."""
        return (f"{self.metric} did not improve by more than {self.config.min_delta:g} in {self.config.patience} "
                f"evaluation(s) (train.early_stopping.patience); best {best_value:.4g} at step {best_step}")

    def ceiling_reason(self, total_steps: int) -> str:
        """Why a run that was not stopped early ended: its planned steps."""
        if not self.config.enabled:
            return f"trained the planned {total_steps} steps (train.early_stopping.enabled: false)"
        return (f"trained the planned {total_steps} steps (the train.epochs or train.steps ceiling); {self.metric} "
                f"had not gone {self.config.patience} evaluation(s) without improving")
