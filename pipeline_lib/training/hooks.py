"""The small interfaces the training loop calls out through: a metrics sink, step hooks and the phases of a task."""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Protocol


class Phase(enum.StrEnum):
    """Where a training task is; the watchdog bounds each phase's silence separately.

    STARTING: import, preflight and restore. STEPPING: running steps. SAVING: a checkpoint with its evaluation.
    FINISHING: after the last step: the final save, the result and the collective shutdown.
    """

    STARTING = "starting"
    STEPPING = "stepping"
    SAVING = "saving"
    FINISHING = "finishing"


@dataclasses.dataclass(frozen=True)
class Execution:
    """One execution of steps, as the hooks hear it.

    `step`: the global step reached; `steps`: how many ran; `examples`: theirs over all replicas; `seconds`: wall
    seconds since the previous execution ended (input included); `loss`: the last step's; `learning_rate`: the
    optimizer's now; `gradient_norms` and `input_waits_s`: one per step (see `training.step.StepOutputs`), no input
    wait when it was not measured (under op determinism, `train.deterministic`).
    """

    step: int
    steps: int
    examples: int
    seconds: float
    loss: float
    learning_rate: float
    gradient_norms: tuple[float, ...] = ()
    input_waits_s: tuple[float, ...] = ()

    @property
    def gradient_norm(self) -> float:
        """The mean gradient norm of the execution's steps (NaN when none was measured)."""
        return _mean(self.gradient_norms)

    @property
    def input_wait_s(self) -> float:
        """The mean input wait of the execution's steps, in seconds (NaN when none was measured)."""
        return _mean(self.input_waits_s)


def _mean(values: tuple[float, ...]) -> float:
    return math.fsum(values) / len(values) if values else math.nan


class MetricsSink(Protocol):
    """Where the chief logs metrics: `log_metrics` buffers or sends one step's values, `flush` sends the rest."""

    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...

    def flush(self) -> None: ...


class NullSink:
    """Discards everything: what non-chief workers get."""

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        pass

    def flush(self) -> None:
        pass


class TrainHooks:
    """Callbacks the loop calls at step boundaries; the defaults do nothing.

    `on_restored(step)` gets the step the run resumes from (0 for a fresh run), before the first step.
    `on_step_end(step, examples, loss)` gets the global step just finished, the examples of that
    step over all replicas, and its loss. `on_phase(phase, step)` is called when the task enters another
    `Phase` (a save, back to stepping, the finish). `stop_requested()` is polled between executions; when
    it returns True (on any worker) the loop saves a checkpoint and raises TrainingInterrupted. `input_batches` may
    wrap each input pipeline's batches of a synchronous strategy.
    """

    def on_restored(self, step: int) -> None:
        pass

    def on_step_end(self, step: int, examples: int, loss: float) -> None:
        pass

    def on_phase(self, phase: Phase, step: int) -> None:
        pass

    def on_execution(self, execution: Execution) -> None:
        """After each execution of steps, with what it measured."""

    def on_checkpoint(self, step: int, seconds: float) -> None:
        """After a checkpoint of `step` is saved (its evaluation included), with the seconds it took."""

    def stop_requested(self) -> bool:
        return False

    def input_batches(self, batches, input_pipeline_id: int, start_step: int):
        """The `tf.data.Dataset` of batches one input pipeline feeds from `start_step` on, to use in its place (a
        watcher's map); the default is the dataset itself."""
        return batches

    def input_done(self, iterator) -> None:
        """Given a synchronous strategy's input iterator once the loop is done with it (finished or interrupted);
        the default keeps nothing, so the iterator is released when the loop returns."""
