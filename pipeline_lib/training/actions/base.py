"""`LoopAction`: one behaviour the training loop's controller runs at its points, besides stepping and saving."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from pipeline_lib.checkpoints.records import CheckpointRecord
from pipeline_lib.training.agreement import GroupStop
from pipeline_lib.training.early_stopping import EarlyStop
from pipeline_lib.training.hooks import Execution


class LoopAction:
    """One behaviour of the outer loop, in the style of Orbit's `Controller(train_actions=[...])`: the controller
    calls every action it was given, in list order, at each of its points, and each point's default does nothing.
    A new behaviour is a new action (a module in `training.actions`) in the caller's list; no signature changes.

    The points, in the order an execution meets them:
    - `on_start(step, restored)`: before the first execution, at the step the run starts from (`restored`: the
      checkpoint restored, None for a fresh run). Returns the stop the restored run had already reached, if any.
    - `next_boundary(step)`: a step ahead of `step` at which an execution must end, None for none.
    - `after_execution(execution)`: after each execution is accounted (hooks, progress record).
    - `after_log(step)`: after the progress line of `step` (the chief's TensorBoard summaries) was written.
    - `before_save(step)`: before the checkpoint of `step` is written.
    - `on_evaluation(step, metrics)`: the chief's evaluation of the checkpoint of `step`.
    - `stop_outcome()`: after a checkpoint, the stop this action calls for (the first action's stop wins); the
      group agrees on it.
    - `after_agreement(step, agreed, checkpoint)`: what the group agreed after the execution that reached `step`;
      `checkpoint()` saves `step` unless it is saved already and returns the checkpoint's path.
    - `describe_stop(agreed)`: this worker's words for an agreed stop it did not make itself, None for none.
    - `close()`: the loop is over (finished, stopped or failed).
    """

    def on_start(self, step: int, restored: CheckpointRecord | None) -> EarlyStop | None:
        return None

    def next_boundary(self, step: int) -> int | None:
        return None

    def after_execution(self, execution: Execution) -> None:
        pass

    def after_log(self, step: int) -> None:
        pass

    def before_save(self, step: int) -> None:
        pass

    def on_evaluation(self, step: int, metrics: Mapping[str, float]) -> None:
        pass

    def stop_outcome(self) -> EarlyStop | None:
        return None

    def after_agreement(self, step: int, agreed: GroupStop, checkpoint: Callable[[], str]) -> None:
        pass

    def describe_stop(self, agreed: GroupStop) -> str | None:
        return None

    def close(self) -> None:
        pass
