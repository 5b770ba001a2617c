"""The outer loop's work between executions: step hooks, progress logs, checkpoints and the loop's actions."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence

from pipeline_lib.checkpoints import layout
from pipeline_lib.checkpoints.records import TRAIN_LOSS_METRIC, CheckpointRecord
from pipeline_lib.config import TrainConfig
from pipeline_lib.planning.batch import BatchScaling
from pipeline_lib.training.actions.base import LoopAction
from pipeline_lib.training.agreement import GroupStop
from pipeline_lib.training.early_stopping import EarlyStop
from pipeline_lib.training.elastic import ElasticAttempt
from pipeline_lib.training.hooks import Execution, Phase, TrainHooks
from pipeline_lib.training.progress import ProgressLogger, current_learning_rate
from pipeline_lib.training.setup import TrainingState
from pipeline_lib.training.step import StepOutputs

logger = logging.getLogger(__name__)


class LoopController:
    """What both training loops do between executions.

    `steps_to_next` bounds each run of steps by the next log step, the next checkpoint step, the end and the
    actions' boundaries; `after_execution` calls the step hooks, logs, checkpoints and honours what the group agreed:
    the actions act on it (a stop request saves and interrupts: `actions.preemption`), and an early stop (an action's
    `stop_outcome` at a checkpoint: `actions.early_stopping`, `actions.pruning`) finishes at that step; `finish`
    saves the last step. A checkpoint is evaluated (chief) after `store.save` writes it and then published; an elastic
    attempt's (`attempt`) keeps its data position. The hooks hear each phase change: SAVING around a checkpoint,
    FINISHING from the last step on. Everything else the loop does is an action (`training.actions`), run in the
    order given.

    A run restored at its last step, or where early stopping had ended it, trains nothing: its loss is the one its
    checkpoint recorded.
    """

    def __init__(self, train_config: TrainConfig, total_steps: int, attempt: BatchScaling, state: TrainingState,
                 hooks: TrainHooks, progress: ProgressLogger, evaluate: Callable[[], dict[str, float]] | None,
                 actions: Sequence[LoopAction] = ()):
        self.config, self.total_steps, self.attempt = train_config, total_steps, attempt
        self.state, self.hooks, self.progress, self.evaluate = state, hooks, progress, evaluate
        self.actions = tuple(actions)
        restored = state.restored
        # The loss the restored checkpoint recorded, until a step runs.
        self.step = state.start_step
        self.last_loss = restored.metrics.get(TRAIN_LOSS_METRIC, math.nan) if restored is not None else math.nan
        self._last_saved = state.start_step if state.start_step else -1
        self._phase = Phase.STARTING
        self._execution_started = time.monotonic()
        self.early_stop: EarlyStop | None = None  # set when the group agreed to stop early (or a pruner's stop)
        for action in self.actions:
            stop = action.on_start(self.step, restored)  # early stopping replays the restored evaluation
            if self.early_stop is None:
                self.early_stop = stop

    @property
    def is_done(self) -> bool:
        """Whether the loop ends: the planned steps ran, or the group agreed to stop early."""
        return self.step >= self.total_steps or self.early_stop is not None

    def steps_to_next(self, limit: int) -> int:
        """Steps to run next: at most `limit`, and none past the next log or checkpoint step, the end or an action's
        boundary (a profile window's edge)."""
        log_every, save_every = self.config.log_every_steps, self.config.checkpoint_every_steps
        boundaries = [action.next_boundary(self.step) for action in self.actions]
        return min(limit, self.total_steps - self.step, log_every - self.step % log_every,
                   save_every - self.step % save_every, *(b - self.step for b in boundaries if b is not None))

    def after_execution(self, outputs: StepOutputs, agree: Callable[[EarlyStop | None], GroupStop]) -> None:
        """Account for the steps just run (`outputs`: each field one value per step), then ask the group (`agree`,
        given this worker's early stop) whether to stop: the actions act on what was agreed (the preemption action
        raises TrainingInterrupted on a stop request); finishes at this step on an early stop."""
        self._enter(Phase.STEPPING)
        losses = [float(loss) for loss in outputs.loss]
        global_batch = self.attempt.global_batch
        for offset, loss in enumerate(losses):
            self.hooks.on_step_end(self.step + offset + 1, global_batch, loss)
        self.step += len(losses)
        self.last_loss = losses[-1]
        execution = Execution(
            step=self.step, steps=len(losses), examples=len(losses) * global_batch,
            seconds=time.monotonic() - self._execution_started, loss=self.last_loss,
            learning_rate=current_learning_rate(self.state.optimizer),
            gradient_norms=tuple(float(norm) for norm in outputs.gradient_norm if math.isfinite(norm)),
            input_waits_s=tuple(float(wait) for wait in outputs.input_wait_s if math.isfinite(wait)))
        self.hooks.on_execution(execution)
        self.progress.record(execution)
        if not math.isfinite(self.last_loss):
            logger.warning("loss is %s at step %d", self.last_loss, self.step)
        step = self.step
        for action in self.actions:
            action.after_execution(execution)
        if step % self.config.log_every_steps == 0 or step == self.total_steps:
            self.progress.log(step, self.last_loss, execution.learning_rate)
            for action in self.actions:
                action.after_log(step)
        if step == self.total_steps:
            self.finish()
            return
        if step % self.config.checkpoint_every_steps == 0:
            self._save_checkpoint(step)
        # An early stop is decided at an evaluation, which is a checkpoint (the chief's; other workers' never stop);
        # the first action's stop wins.
        early = None
        if self._last_saved == step:
            early = next((stop for action in self.actions if (stop := action.stop_outcome()) is not None), None)
        agreed = agree(early)

        def checkpoint() -> str:
            record = self._save_checkpoint(step) if self._last_saved != step else None
            return record.path if record is not None else layout.prefix_for(
                self.state.run_storage.local_checkpoint_dir, step)

        for action in self.actions:
            action.after_agreement(step, agreed, checkpoint)
        if agreed.early:
            self._stop_early(agreed, early)
            return
        self._execution_started = time.monotonic()  # the next execution's time starts after this bookkeeping

    def finish(self) -> None:
        """Enter the FINISHING phase and save the last step unless it is saved already."""
        self._enter(Phase.FINISHING)
        if self._last_saved != self.step:
            self._save_checkpoint(self.step)

    def _stop_early(self, agreed: GroupStop, own: EarlyStop | None) -> None:
        """Every worker: record the early stop the group agreed (its best step and value, the same everywhere) and
        finish at this step (saved already: the stop is decided at an evaluation, which is a checkpoint). The chief
        made the stop (`own`) and keeps its reason; the other workers describe it from what was agreed."""
        if own is not None and own.pruned == agreed.pruned:
            reason = own.reason
        else:
            reason = next((words for action in self.actions if (words := action.describe_stop(agreed))), None)
        if reason is None:  # no action of this worker's made or describes it: a tuning trial's prune (the chief's)
            made_by = "pruned by the tuning trial's pruner" if agreed.pruned else "stopped early by the chief"
            reason = f"{made_by} at step {self.step}; best {agreed.best_value:.4g} at step {agreed.best_step}"
        self.early_stop = EarlyStop(agreed.best_step, agreed.best_value, reason, pruned=agreed.pruned)
        logger.info("%s at step %d of %d: %s", "pruned" if agreed.pruned else "early stop", self.step,
                    self.total_steps, reason)
        self.finish()

    def _enter(self, phase: Phase) -> None:
        if phase != self._phase:
            self._phase = phase
            self.hooks.on_phase(phase, self.step)

    def close(self) -> None:
        """Close the actions (a trace still running stops, a remote run's chief uploads its last TensorBoard files),
        then the progress writers."""
        for action in self.actions:
            action.close()
        self.progress.close()

    def _save_checkpoint(self, at_step: int) -> CheckpointRecord | None:
        # The final save belongs to FINISHING; any other is SAVING, and stepping resumes after it.
        resume = self._phase
        if resume != Phase.FINISHING:
            self._enter(Phase.SAVING)
        for action in self.actions:
            action.before_save(at_step)
        self.state.step_var.assign(at_step)
        train_loss = self.last_loss

        def measure() -> dict[str, float]:
            metrics = self.evaluate() if self.evaluate is not None else {}
            self.progress.log_eval(at_step, metrics)
            for action in self.actions:
                action.on_evaluation(at_step, metrics)
            return {**metrics, TRAIN_LOSS_METRIC: train_loss} if math.isfinite(train_loss) else metrics

        started = time.monotonic()
        # An elastic attempt's checkpoints keep where it stands in the data, for an attempt of any size to go on.
        position = self.attempt.position_at(at_step) if isinstance(self.attempt, ElasticAttempt) else None
        record = self.state.store.save(at_step, metrics_fn=measure, data_position=position)
        self._publish_to_run_dir(record)
        self.hooks.on_checkpoint(at_step, time.monotonic() - started)
        self._last_saved = at_step
        self._enter(resume)
        return record

    def _publish_to_run_dir(self, record: CheckpointRecord | None) -> None:
        """Chief of a remote run: upload the checkpoint just saved (manifest last), then its TensorBoard logs."""
        run_storage = self.state.run_storage
        if record is None or not run_storage.is_remote:
            return
        self.progress.flush_summaries()
        store = self.state.store
        run_storage.publish_checkpoint(record, keep=self.config.keep_checkpoints, best_metric=store.best_metric,
                                       best_direction=store.best_direction)
