"""Progress events to a Prefect progress artifact and to the in-process event bus (the `tfdag run` console).

Each stage's task creates one reporter; the library calls it through a plain callback.
"""

from __future__ import annotations

from prefect.artifacts import create_progress_artifact, update_progress_artifact

from pipeline_lib.core import events
from pipeline_lib.core.events import ConversionProgress, TrainProgress
from pipeline_lib.training.results import TrainResult


def artifact_key(text: str) -> str:
    """Prefect artifact keys allow lowercase letters, numbers and dashes only."""
    return "".join(c if c.isalnum() else "-" for c in text.lower()).strip("-")[:90]


class ProgressArtifact:
    """One Prefect progress artifact of the running task: percent done and a one-line description."""

    def __init__(self, key: str, description: str):
        self.artifact_id = create_progress_artifact(0.0, key=artifact_key(key), description=description)

    def update(self, percent: float, description: str) -> None:
        update_progress_artifact(self.artifact_id, max(0.0, min(percent, 100.0)), description=description)


class ConversionReporter:
    """The convert task's `progress_fn`: the artifact `<pipeline>-conversion-progress` and the event bus.

    `convert` reports at most once a second, so every report goes to the server.
    """

    def __init__(self, pipeline: str):
        self.artifact = ProgressArtifact(f"{pipeline}-conversion-progress", "conversion: starting")

    def __call__(self, progress: ConversionProgress) -> None:
        fraction = progress.fraction
        self.artifact.update(100.0 * (fraction or 0.0),
                             ("conversion: done, " if progress.done else "conversion: ") + progress.describe())
        events.emit(progress)


class TrainingReporter:
    """The train task's `on_progress`: the artifact `<pipeline>-training-progress` and the event bus.

    The supervisor reports the chief's heartbeat at most every `PROGRESS_INTERVAL_S`.
    """

    def __init__(self, pipeline: str, total_steps: int):
        self.artifact = ProgressArtifact(f"{pipeline}-training-progress", f"training: step 0 of {total_steps}")

    def __call__(self, progress: TrainProgress) -> None:
        # The flow run's page shows how far training is while it runs.
        self.artifact.update(100.0 * progress.step / max(progress.total_steps, 1), "training: " + progress.describe())
        events.emit(progress)

    def done(self, result: TrainResult) -> None:
        """Training returned: 100 %, with the final step and loss, and the last checkpoint's eval metrics."""
        last = max(result.checkpoints, key=lambda r: r.step).metrics if result.checkpoints else {}
        progress = TrainProgress(step=result.final_step, total_steps=result.total_steps, loss=result.final_loss,
                                 examples_per_second=result.examples_per_sec,
                                 eval_metrics={k: v for k, v in last.items() if k.startswith("eval_")})
        early = f" (stopped early, best step {result.best_step}: {result.stop_reason})" if result.stopped_early else ""
        self.artifact.update(100.0, f"training: done at step {result.final_step} of {result.total_steps}, "
                             f"loss {result.final_loss:.4f}{early}")
        events.emit(progress)
