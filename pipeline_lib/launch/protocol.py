"""`Launcher`, what every launcher module provides, and `LaunchOptions`, the keyword options of a launch.

A launcher is a module (`launch.local`, `launch.in_process`, `launch.ray_launcher`) whose public names satisfy
`Launcher`; `launch.launchers` is the one place that names them and picks one for a config.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Protocol, runtime_checkable

from pydantic import BaseModel

from pipeline_lib.config import PipelineConfig
from pipeline_lib.data.manifest import Manifest
from pipeline_lib.launch.supervisor import TrainProgress
from pipeline_lib.planning.sharding import ShardPlan
from pipeline_lib.training.results import ResizeRecord, TrainResult


@dataclasses.dataclass(frozen=True)
class LaunchOptions:
    """How a caller follows a launch; every launcher takes the same ones.

    Attributes:
        mlflow_run_id: the MLflow run the chief logs to (None: no tracking).
        log_fn: receives every output line of every task, prefixed `[worker 1] `, one line at a time.
        on_restart: called as `on_restart(n, story)` once restart n (1-based) resumed: its cause and step.
        env: extra environment variables for the workers (e.g. a test's faults).
        on_progress: called with the chief's progress (step of total, loss, examples/s) every few seconds.
        on_resize: an elastic run's resize (`ResizeRecord`: from, to, step, reason), once the resized group restored.
    """

    mlflow_run_id: str | None = None
    log_fn: Callable[[str], None] = print
    on_restart: Callable[[int, str], None] | None = None
    env: Mapping[str, str] | None = None
    on_progress: Callable[[TrainProgress], None] | None = None
    on_resize: Callable[[ResizeRecord], None] | None = None


DEFAULT_OPTIONS = LaunchOptions()  # untracked, every line printed


@runtime_checkable
class Launcher(Protocol):
    """What a launcher module provides (a module satisfies a Protocol through its module-level names). Not to be
    confused with `config.Launcher`, the enum of the values `train.launcher` accepts.

    Attributes:
        name: the launcher's name: its `train.launcher` value (`in_process`: `train.isolation: none`).
        config_model: the model of its own settings, the section `train.<name>` (None: it has none).
    """

    name: str
    config_model: type[BaseModel] | None

    def check_inputs(self, config: PipelineConfig, environ: Mapping[str, str] | None = None) -> None:
        """Check what this launcher needs from the world, before the flow starts (e.g. where its cluster is).

        Raises:
            UserError: the input that cannot work, naming the value, where it came from and the fix.
        """

    def warm_up(self, config: PipelineConfig) -> None:
        """Start, in the background, what a later `launch_training` of `config` would wait for (the local launcher:
        its fork server's TensorFlow import, while the flow converts data); return at once. Nothing is required
        of it: a launch works without it."""

    def launch_training(self, config: PipelineConfig, manifest: Manifest, plan: ShardPlan, run_dir: str, *,
                        options: LaunchOptions = DEFAULT_OPTIONS) -> TrainResult:
        """Train `config` on `manifest` under `plan` into `run_dir`, supervise to the end, return the chief's
        TrainResult (with its restarts).

        Raises:
            LaunchError: a task failed permanently, restarts ran out or the launch timed out.
        """
