"""Which launcher trains a config: `train.launcher` picks one module, the one place that knows them all.

Each launcher module has the same `launch_training(config, manifest, plan, run_dir, *, mlflow_run_id, log_fn,
on_restart, env, on_progress) -> TrainResult`. A module is imported only when a config names it, so the local launcher never
imports Ray; a third launcher is one new module and one line here.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping

from pipeline_lib.config import Isolation, Launcher, PipelineConfig
from pipeline_lib.data.manifest import Manifest
from pipeline_lib.launch.supervisor import TrainProgress
from pipeline_lib.planning.sharding import ShardPlan
from pipeline_lib.training.results import TrainResult

LAUNCHERS: dict[Launcher, str] = {
    Launcher.LOCAL: "pipeline_lib.launch.local",
    Launcher.RAY: "pipeline_lib.launch.ray_launcher",
}
# `train.isolation: none` (one local worker, validated by TrainConfig): the local launcher over a thread.
IN_PROCESS = "pipeline_lib.launch.in_process"


def launch_training(
    config: PipelineConfig,
    manifest: Manifest,
    plan: ShardPlan,
    run_dir: str,
    *,
    mlflow_run_id: str | None = None,
    log_fn: Callable[[str], None] = print,
    on_restart: Callable[[int, str], None] | None = None,
    env: Mapping[str, str] | None = None,
    on_progress: Callable[[TrainProgress], None] | None = None,
) -> TrainResult:
    """Train with the launcher `config.train.launcher` names (in this process with `train.isolation: none`) and
    return the chief's TrainResult."""
    name = IN_PROCESS if config.train.isolation == Isolation.NONE else LAUNCHERS[config.train.launcher]
    module = importlib.import_module(name)
    return module.launch_training(config, manifest, plan, run_dir, mlflow_run_id=mlflow_run_id, log_fn=log_fn,
                                  on_restart=on_restart, env=env, on_progress=on_progress)
