"""The launcher registry: the one place that names the launcher modules and picks one for a config.

Each module satisfies `launch.protocol.Launcher`. A module is imported only when a config names it, so the local
launcher never imports Ray. A new launcher is one new module and one line in `LAUNCHERS`, with its name in
`config.Launcher` (the values `train.launcher` accepts; see docs/explanation/architecture.md, "Adding a launcher").
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping

from pipeline_lib.config import Isolation, PipelineConfig
from pipeline_lib.data.manifest import Manifest
from pipeline_lib.launch.protocol import DEFAULT_OPTIONS, Launcher, LaunchOptions
from pipeline_lib.planning.sharding import ShardPlan
from pipeline_lib.training.results import TrainResult

__all__ = ["LAUNCHERS", "LaunchOptions", "Launcher", "check_inputs", "get_launcher", "launch_training",
           "launcher_for", "warm_up"]

LAUNCHERS: dict[str, str] = {
    "local": "pipeline_lib.launch.local",
    "ray": "pipeline_lib.launch.ray_launcher",
    # `train.isolation: none` (one local worker, validated by TrainConfig): the local launcher over a thread.
    "in_process": "pipeline_lib.launch.in_process",
}
IN_PROCESS = "in_process"


def get_launcher(name: str) -> Launcher:
    """The launcher module registered as `name`, imported now.

    Raises:
        LookupError: naming the registered launchers, when `name` is not one of them.
    """
    if name not in LAUNCHERS:
        raise LookupError(f"no launcher {name!r} is registered in pipeline_lib.launch.launchers.LAUNCHERS "
                          f"(registered: {', '.join(sorted(LAUNCHERS))}); add its module there")
    return importlib.import_module(LAUNCHERS[name])


def launcher_for(config: PipelineConfig) -> Launcher:
    """The launcher `config.train.launcher` names, or `in_process` with `train.isolation: none`."""
    train = config.train
    return get_launcher(IN_PROCESS if train.isolation == Isolation.NONE else train.launcher.value)


def check_inputs(config: PipelineConfig, environ: Mapping[str, str] | None = None) -> None:
    """The input checks of the config's launcher (`launch.inputs.check_inputs` runs them before a flow starts)."""
    launcher_for(config).check_inputs(config, environ)


def warm_up(config: PipelineConfig) -> None:
    """Let the config's launcher get ready in the background (see `Launcher.warm_up`); returns at once."""
    launcher_for(config).warm_up(config)


def launch_training(config: PipelineConfig, manifest: Manifest, plan: ShardPlan, run_dir: str, *,
                    options: LaunchOptions = DEFAULT_OPTIONS) -> TrainResult:
    """Train with the config's launcher (see `Launcher.launch_training`) and return the chief's TrainResult."""
    return launcher_for(config).launch_training(config, manifest, plan, run_dir, options=options)
