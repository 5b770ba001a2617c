"""`model` and `train`: the model factory, the strategy, the launcher and the loop's settings.

A launcher's own settings are a section of `train` named for it, each in its own module (`config.ray`).
"""

from __future__ import annotations

import enum
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from pipeline_lib.config.base import (
    AutoShard,
    Collective,
    LrScaling,
    Strategy,
    Task,
    _Frozen,
    strategy_for_cluster,
)
from pipeline_lib.config.ray import RayConfig


class ModelConfig(_Frozen):
    factory: str = "mlp"  # "mlp", "cnn" or "module:function"
    params: dict[str, Any] = Field(default_factory=dict)
    task: Task = Task.CLASSIFICATION
    num_classes: int | None = Field(None, ge=2)  # None: inferred from the label values

    @field_validator("factory")
    @classmethod
    def _factory_form(cls, value: str) -> str:
        if value in ("mlp", "cnn"):
            return value
        module, sep, func = value.partition(":")
        if not sep or not module or not func:
            raise ValueError("must be 'mlp', 'cnn' or 'package.module:function'")
        return value


# `train.launcher`: the values a config may name; `launch.launchers` maps each to its module. (A comment, not a
# docstring: the docstring would change the config's JSON schema, Prefect's parameter form.)
class Launcher(str, enum.Enum):
    LOCAL = "local"  # worker processes on this machine
    RAY = "ray"  # one Ray actor per task on a Ray cluster


class Isolation(str, enum.Enum):
    PROCESS = "process"  # every task its own supervised worker process: watchdog kills, restarts, crash isolation
    NONE = "none"  # one worker trains in the train task's own process: no process start (demos, notebooks)


# The metrics the trainer's periodic evaluation records in each checkpoint's manifest (as `eval_<name>`), by task:
# what `train.early_stopping.metric` may name. `training.evaluator.Evaluator` computes exactly these.
CHECKPOINT_EVAL_METRICS: dict[Task, tuple[str, ...]] = {
    Task.CLASSIFICATION: ("loss", "accuracy"),
    Task.REGRESSION: ("loss", "mae", "rmse", "r2"),
}


class EarlyStoppingConfig(_Frozen):
    enabled: bool = True
    # A metric of the trainer's evaluation at each checkpoint (CHECKPOINT_EVAL_METRICS); None: the gate metric,
    # as best-checkpoint selection reads it from the checkpoints (evaluation.gate.metric, `loss` for one the
    # trainer does not compute).
    metric: str | None = None
    patience: int = Field(5, ge=1)  # evaluations (one at each checkpoint) without improvement before stopping
    min_delta: float = Field(0.0, ge=0.0)  # an improvement must exceed this

    def check_metric(self, task: Task) -> None:
        """Raise ValueError when `metric` is not one the trainer's periodic evaluation computes for `task`."""
        fits = CHECKPOINT_EVAL_METRICS[task]
        if self.metric is not None and self.metric.removeprefix("eval_") not in fits:
            raise ValueError(
                f"train.early_stopping.metric ({self.metric!r}) is not computed by the trainer's evaluation at each "
                f"checkpoint for model.task {task.value}; set it to one of {list(fits)}, or leave it out for the "
                "gate metric (or set train.early_stopping.enabled: false)"
            )


class ElasticConfig(_Frozen):
    # The fewest training workers an attempt may restart on after a lost worker (train.workers is the most).
    min_workers: int = Field(ge=1)
    # How long a lost worker's replacement may take to be placed before the group restarts on fewer workers.
    wait_s: float = Field(60.0, gt=0.0)


class TrainConfig(_Frozen):
    launcher: Launcher = Launcher.LOCAL
    isolation: Isolation = Isolation.PROCESS
    ray: RayConfig = RayConfig()
    strategy: Strategy = Strategy.AUTO
    cpu_replicas: int | None = Field(None, ge=1)
    workers: int = Field(1, ge=1)
    parameter_servers: int = Field(0, ge=0)
    per_replica_batch_size: int = Field(32, ge=1)
    base_learning_rate: float = Field(1e-3, gt=0.0)
    lr_scaling: LrScaling = LrScaling.LINEAR
    warmup_steps: int = Field(0, ge=0)
    optimizer: Literal["adam", "sgd"] = "adam"
    epochs: int = Field(100, ge=1)  # the ceiling: early_stopping ends training sooner once it stops improving
    steps: int | None = Field(None, ge=1)  # total steps; overrides epochs
    steps_per_execution: int = Field(1, ge=1)
    shuffle: bool = True
    autoshard: AutoShard = AutoShard.AUTO
    shuffle_buffer: int = Field(10000, ge=1)
    seed: int = 42
    deterministic: bool = False
    mixed_precision: bool = False
    jit_compile: bool = False  # XLA for the forward and backward pass of the step
    checkpoint_every_steps: int = Field(100, ge=1)  # also the evaluation cadence (the chief, on the eval split)
    keep_checkpoints: int = Field(3, ge=1)
    log_every_steps: int = Field(50, ge=1)
    communication: Collective = Collective.AUTO
    gradient_pack_mb: float = Field(0.0, ge=0.0)  # 0: TensorFlow's default packing
    hang_timeout_s: float = Field(300.0, gt=0.0)
    max_restarts: int = Field(3, ge=0)
    restart_backoff_s: float = Field(1.0, ge=0.0)
    timeout_s: float | None = Field(None, gt=0.0)
    warm_start_uri: str | None = None
    early_stopping: EarlyStoppingConfig = EarlyStoppingConfig()
    # Resize on lost workers (None: off): every attempt keeps the global batch and continues the epoch's order.
    elastic: ElasticConfig | None = None

    def uses_parameter_server(self, cluster_has_ps: bool | None = None) -> bool:
        """Whether this run trains under parameter_server: the one rule launcher, worker and strategy share.

        `strategy: parameter_server` always does; `auto` does when there are ps tasks: those TF_CONFIG lists
        (`cluster_has_ps`, once a cluster exists) or, before the launcher starts one, `parameter_servers` > 0.
        """
        has_ps = cluster_has_ps if cluster_has_ps is not None else self.parameter_servers > 0
        return strategy_for_cluster(self.strategy, has_ps=has_ps, num_workers=1) == Strategy.PARAMETER_SERVER

    def elastic_workers_problem(self, num_workers: int) -> str | None:
        """Why an attempt of this elastic run cannot train on `num_workers` workers (in words), or None when it can:
        the one rule for the launcher, before it starts an attempt, and for the training side, which takes the count
        from its cluster."""
        assert self.elastic is not None, "elastic_workers_problem is for train.elastic runs"
        if self.elastic.min_workers <= num_workers <= self.workers:
            return None
        return (f"{num_workers} training worker(s) for an elastic attempt, which needs between "
                f"train.elastic.min_workers ({self.elastic.min_workers}) and train.workers ({self.workers})")

    @model_validator(mode="after")
    def _combinations(self) -> TrainConfig:
        if self.parameter_servers and self.strategy not in (Strategy.PARAMETER_SERVER, Strategy.AUTO):
            raise ValueError(
                f"parameter_servers ({self.parameter_servers}) needs strategy 'parameter_server', "
                f"not '{self.strategy.value}'; set train.strategy: parameter_server or parameter_servers: 0"
            )
        if self.strategy == Strategy.PARAMETER_SERVER and self.workers > 1 and self.parameter_servers < 1:
            raise ValueError(
                "strategy 'parameter_server' with workers > 1 needs train.parameter_servers ≥ 1"
            )
        if self.isolation == Isolation.NONE and (self.workers > 1 or self.parameter_servers
                                                  or self.launcher != Launcher.LOCAL):
            raise ValueError(
                f"train.isolation 'none' trains one worker in the task's own process, but this config asks for "
                f"{self.workers} worker(s), {self.parameter_servers} parameter server(s) on the "
                f"'{self.launcher.value}' launcher; set train.isolation: process (the default) for a cluster"
            )
        if self.strategy == Strategy.MULTI_WORKER_MIRRORED and self.parameter_servers:
            raise ValueError("strategy 'multi_worker_mirrored' cannot use parameter servers; set parameter_servers: 0")
        if self.elastic is not None:
            self._check_elastic(self.elastic.min_workers)
        return self

    def _check_elastic(self, minimum: int) -> None:
        """`train.elastic` resizes a multi-worker group (synchronous, or parameter-server workers) over one global
        order of the data."""
        where = f"train.elastic.min_workers ({minimum})"
        if self.workers < 2:
            raise ValueError(f"{where} with train.workers {self.workers}: one worker has nothing to shrink to; "
                             "raise train.workers to 2 or more, or remove train.elastic")
        if minimum > self.workers:
            raise ValueError(f"{where} is more than train.workers ({self.workers}), the most an attempt runs on; "
                             f"set train.elastic.min_workers between 1 and {self.workers}")
        if self.strategy not in (Strategy.AUTO, Strategy.MULTI_WORKER_MIRRORED, Strategy.PARAMETER_SERVER):
            raise ValueError(f"{where} with train.strategy '{self.strategy.value}', a one-worker strategy; use "
                             "multi_worker_mirrored, parameter_server (or auto), or remove train.elastic")
        if self.autoshard == AutoShard.FILE:
            raise ValueError(f"{where} with train.autoshard 'file': an elastic run has every worker read every file "
                             "(one global order, re-split on each resize); set train.autoshard: auto or data")
