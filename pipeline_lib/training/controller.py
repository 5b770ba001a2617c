"""The outer loop's work between executions: step hooks, progress logs, checkpoints, stop requests, early stops."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

from pipeline_lib.checkpoints import layout
from pipeline_lib.checkpoints.records import (
    TRAIN_LOSS_METRIC,
    CheckpointRecord,
    DataPosition,
)
from pipeline_lib.config import TrainConfig
from pipeline_lib.training.agreement import GroupStop
from pipeline_lib.training.early_stopping import EarlyStop, EarlyStopping, StopRule
from pipeline_lib.training.errors import TrainingInterrupted
from pipeline_lib.training.hooks import Execution, Phase, TrainHooks
from pipeline_lib.training.profiling import ProfileWindow
from pipeline_lib.training.progress import ProgressLogger, current_learning_rate
from pipeline_lib.training.setup import TrainingState
from pipeline_lib.training.step import StepOutputs

logger = logging.getLogger(__name__)


class LoopController:
    """What both training loops do between executions.

    `steps_to_next` bounds each run of steps by the next log step, the next checkpoint step and the end;
    `after_execution` calls the step hooks, logs, checkpoints and honours what the group agreed: a stop request
    or the chief's early stop (`early_stopping` observes each evaluation, and so does `stop_rule`, a tuning trial's
    pruner, whose stop ends training the same way); `finish` saves the last step; an elastic run's checkpoints keep
    its data position (`data_position_fn`). A
    checkpoint is evaluated (chief) after `store.save` writes it and then published; `before_save` runs first
    (the parameter-server coordinator's join, so the saved variables hold every scheduled step). The hooks hear
    each phase change: SAVING around a checkpoint, FINISHING from the last step on.

    A run restored at its last step, or where early stopping had ended it, trains nothing: its loss is
    `restored_loss`, the one its checkpoint recorded.
    """

    def __init__(self, train_config: TrainConfig, total_steps: int, global_batch: int, state: TrainingState,
                 hooks: TrainHooks, progress: ProgressLogger, evaluate: Callable[[], dict[str, float]] | None,
                 before_save: Callable[[], None] | None = None, restored_loss: float = float("nan"),
                 profile: ProfileWindow | None = None, early_stopping: EarlyStopping | None = None,
                 stop_rule: StopRule | None = None, data_position_fn: Callable[[int], DataPosition] | None = None):
        self.config, self.total_steps, self.global_batch = train_config, total_steps, global_batch
        self.state, self.hooks, self.progress = state, hooks, progress
        self.evaluate, self.before_save = evaluate, before_save
        # The loss the restored checkpoint recorded, until a step runs.
        self.step, self.last_loss = state.start_step, restored_loss
        self._last_saved = state.start_step if state.start_step else -1
        self._phase = Phase.STARTING
        self._execution_started = time.monotonic()
        self.profile = profile
        if profile is not None:
            profile.at(self.step)
        self.early_stopping = early_stopping
        # Not replayed on a restore: its outcome may depend on what other processes did since (a pruner's study).
        self.stop_rule = stop_rule
        self.data_position_fn = data_position_fn  # an elastic run's position at a step, kept with its checkpoint
        self.early_stop: EarlyStop | None = None  # set when the group agreed to stop early (or a pruner's stop)
        if early_stopping is not None:
            early_stopping.replay(state.restored)
            self.early_stop = early_stopping.outcome()
            if self.early_stop is not None:
                logger.info("resumed at step %d, where early stopping had ended training: %s", self.step,
                            self.early_stop.reason)

    @property
    def is_done(self) -> bool:
        """Whether the loop ends: the planned steps ran, or the group agreed to stop early."""
        return self.step >= self.total_steps or self.early_stop is not None

    def steps_to_next(self, limit: int) -> int:
        """Steps to run next: at most `limit`, and none past the next log or checkpoint step or the end."""
        log_every, save_every = self.config.log_every_steps, self.config.checkpoint_every_steps
        boundary = self.profile.next_boundary(self.step) if self.profile is not None else None
        return min(limit, self.total_steps - self.step, log_every - self.step % log_every,
                   save_every - self.step % save_every, (boundary - self.step) if boundary else limit)

    def after_execution(self, outputs: StepOutputs, agree: Callable[[EarlyStop | None], GroupStop]) -> None:
        """Account for the steps just run (`outputs`: each field one value per step), then ask the group (`agree`,
        given this worker's early stop) whether to stop: raises TrainingInterrupted on a stop request; finishes at
        this step on an early stop."""
        self._enter(Phase.STEPPING)
        losses = [float(loss) for loss in outputs.loss]
        for offset, loss in enumerate(losses):
            self.hooks.on_step_end(self.step + offset + 1, self.global_batch, loss)
        self.step += len(losses)
        self.last_loss = losses[-1]
        execution = Execution(
            step=self.step, steps=len(losses), examples=len(losses) * self.global_batch,
            seconds=time.monotonic() - self._execution_started, loss=self.last_loss,
            learning_rate=current_learning_rate(self.state.optimizer),
            gradient_norms=tuple(float(norm) for norm in outputs.gradient_norm if math.isfinite(norm)),
            input_waits_s=tuple(float(wait) for wait in outputs.input_wait_s if math.isfinite(wait)))
        self.hooks.on_execution(execution)
        self.progress.record(execution)
        if not math.isfinite(self.last_loss):
            logger.warning("loss is %s at step %d", self.last_loss, self.step)
        step = self.step
        if self.profile is not None:
            self.profile.at(step)
        if step % self.config.log_every_steps == 0 or step == self.total_steps:
            self.progress.log(step, self.last_loss, execution.learning_rate)
            self._upload_tensorboard(flush=True)
        if step == self.total_steps:
            self.finish()
            return
        if step % self.config.checkpoint_every_steps == 0:
            self._save_checkpoint(step)
        # Early stopping decides at an evaluation, which is a checkpoint (the chief's; other workers' never stop);
        # patience first, so a trial that would have stopped anyway is not counted as pruned.
        early = None
        if self._last_saved == step:
            if self.early_stopping is not None:
                early = self.early_stopping.outcome()
            if early is None and self.stop_rule is not None:
                early = self.stop_rule.outcome()
        agreed = agree(early)
        if agreed.requested:
            record = self._save_checkpoint(step) if self._last_saved != step else None
            raise TrainingInterrupted(step, record.path if record is not None else
                                      layout.prefix_for(self.state.run_storage.local_checkpoint_dir, step))
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
        elif agreed.pruned:
            reason = (f"pruned by the tuning trial's pruner at step {self.step}; best {agreed.best_value:.4g} at step "
                      f"{agreed.best_step}")
        else:
            assert self.early_stopping is not None
            reason = self.early_stopping.describe(agreed.best_step, agreed.best_value)
        self.early_stop = EarlyStop(agreed.best_step, agreed.best_value, reason, pruned=agreed.pruned)
        logger.info("%s at step %d of %d: %s", "pruned" if agreed.pruned else "early stop", self.step,
                    self.total_steps, reason)
        self.finish()

    def _enter(self, phase: Phase) -> None:
        if phase != self._phase:
            self._phase = phase
            self.hooks.on_phase(phase, self.step)

    def close(self) -> None:
        """Stop a trace still running, close the progress writers and upload the last TensorBoard files (a remote
        run's chief)."""
        if self.profile is not None:
            self.profile.close()
        self.progress.close()
        self._upload_tensorboard(flush=False)

    def _save_checkpoint(self, at_step: int) -> CheckpointRecord | None:
        # The final save belongs to FINISHING; any other is SAVING, and stepping resumes after it.
        resume = self._phase
        if resume != Phase.FINISHING:
            self._enter(Phase.SAVING)
        if self.before_save is not None:
            self.before_save()
        self.state.step_var.assign(at_step)
        train_loss = self.last_loss

        def measure() -> dict[str, float]:
            metrics = self.evaluate() if self.evaluate is not None else {}
            self.progress.log_eval(at_step, metrics)
            if self.early_stopping is not None:
                self.early_stopping.observe(at_step, metrics)
            if self.stop_rule is not None:
                self.stop_rule.observe(at_step, metrics)
            return {**metrics, TRAIN_LOSS_METRIC: train_loss} if math.isfinite(train_loss) else metrics

        started = time.monotonic()
        position = self.data_position_fn(at_step) if self.data_position_fn is not None else None
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

    def _upload_tensorboard(self, *, flush: bool) -> None:
        """Chief of a remote run: upload the TensorBoard files that changed (after flushing the writer)."""
        if self.state.run_storage.tensorboard_sync is None:
            return
        if flush:
            self.progress.flush_summaries()
        self.state.run_storage.sync_tensorboard()
