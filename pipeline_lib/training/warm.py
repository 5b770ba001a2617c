"""`warm_runtime`: a process that has not trained yet made to train at the speed of one that has.

A fresh worker process pays for its first `train()` more than a process that already ran one: the eager context and
its thread pools start, the Keras, tf.data, checkpoint and tracing modules load lazily, AutoGraph converts the
loop's, the step's and the evaluator's functions (converted once per process, by their code), and each op's first
kernels are looked up. Measured here on digits: 3.1 s of CPU for a first 500-step `train()` against 1.25 s for the
next ones in the same process. A tiny model of its own recovers little of that (0.7 s): what is cold is this
project's own functions. So the fork server's spare child (`launch.forkserver`, `launch.worker.warm_up`) runs a real
`train()` of a few steps with the config, dataset and plan of the launch before it (a trial of the same study), in a
temp directory, before its task arrives. The runtime this starts cannot be reconfigured: only a task that splits no
CPU into logical devices and joins no cluster may run on it (`launch.spec.runs_on_a_warm_runtime`).
"""

from __future__ import annotations

import glob
import os
import shutil
import tempfile

import keras

from pipeline_lib.config import parse_config
from pipeline_lib.data.manifest import Manifest
from pipeline_lib.planning.sharding import ShardPlan

WARM_UP_EXECUTIONS = 2  # executions of train.steps_per_execution steps; the last saves a checkpoint and evaluates
_DIR_PREFIX = "tfdag-warm-up-"  # + the spare's pid, in the temp directory: its run directory


def warm_runtime(config_values: dict, manifest: Manifest, plan: ShardPlan) -> None:
    """Train `config_values` (a config's values, as a worker spec holds them) for a few steps on `manifest` and
    `plan` in a temp directory (removed after, or by a later warm-up when this process is killed first): no
    tracking, preflight, profile, tuning trial, early stop or warm start; then forget the model (Keras' session
    cleared: the task's layer names are those of a fresh process; it seeds itself)."""
    from pipeline_lib.training.loop import train

    values = {key: value for key, value in config_values.items() if key != "tune_trial"}
    train_values = dict(values.get("train") or {})
    steps = WARM_UP_EXECUTIONS * int(train_values.get("steps_per_execution") or 1)
    train_values.update(steps=steps, checkpoint_every_steps=steps, log_every_steps=steps, warm_start_uri=None,
                        early_stopping={"enabled": False}, elastic=None, timeout_s=None)
    values["train"] = train_values
    values["tracking"] = {**(values.get("tracking") or {}), "enabled": False}
    values["preflight"] = {**(values.get("preflight") or {}), "enabled": False}
    values["observability"] = {**(values.get("observability") or {}), "profile_steps": None}
    config = parse_config(values, source="the warm-up of the fork server's spare")
    _remove_orphans()
    run_dir = os.path.join(tempfile.gettempdir(), f"{_DIR_PREFIX}{os.getpid()}")
    try:
        train(config, manifest, plan, run_dir)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    keras.backend.clear_session()


def _remove_orphans() -> None:
    """Remove the warm-up directories of spares that were killed while they warmed up (the fork server ends its
    spare with SIGKILL when it goes, so no cleanup of theirs ran); each is named by its process id."""
    for path in glob.glob(os.path.join(tempfile.gettempdir(), f"{_DIR_PREFIX}*")):
        pid = path.rsplit("-", 1)[-1]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            shutil.rmtree(path, ignore_errors=True)
