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
    """`mlp`, `cnn`, or `package.module:function`: a `pipeline_lib.training.models.ModelFactory`, called with one
    `FactoryInputs` (`schema`, `num_outputs`, `task`, `params` = `model.params`, `statistics` = the dataset
    statistics, `label_statistics` = the label's train-split statistics for a regression) and returning a
    keras.Model. A function written as `fn(schema, num_outputs, **params)` (with `statistics=` /
    `label_statistics=` when it has those parameters) is still called that way"""
    params: dict[str, Any] = Field(default_factory=dict)
    """factory parameters (`hidden_units`, `dropout`; `image_shape`, `filters` for `cnn`)"""
    task: Task = Task.CLASSIFICATION
    """or `regression`; the evaluation defaults follow it (see Defaults)"""
    num_classes: int | None = Field(None, ge=2)  # None: inferred from the label values
    """number of classes"""

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
    """stop once the eval metric stops improving (see Defaults); `false`: train to the ceiling"""
    # A metric of the trainer's evaluation at each checkpoint (CHECKPOINT_EVAL_METRICS); None: the gate metric,
    # as best-checkpoint selection reads it from the checkpoints (evaluation.gate.metric, `loss` for one the
    # trainer does not compute).
    metric: str | None = None
    """a metric the trainer evaluates at each checkpoint: `loss`, `accuracy` (classification), `mae`, `rmse`,
    `r2` (regression); another is a config error naming it. Unset: `evaluation.gate.metric` as best-checkpoint
    selection reads it (`loss` for one the trainer does not compute, such as `auc`), so the best step is the
    checkpoint `select: best` exports"""
    patience: int = Field(5, ge=1)  # evaluations (one at each checkpoint) without improvement before stopping
    """evaluations (one per `checkpoint_every_steps`) in a row without an improvement before training stops"""
    min_delta: float = Field(0.0, ge=0.0)  # an improvement must exceed this
    """an improvement must exceed this"""

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
    """an elastic run: a lost worker restarts the group on the K workers that can be placed, `min_workers` ≤ K ≤
    `train.workers`, and it grows back when capacity returns, keeping the global batch and each epoch's order
    (see Elastic training). Refused (naming the value and the fix) with `workers: 1`, `min_workers` >
    `workers`, a one-worker strategy or `autoshard: file`; parameter-server training resizes its workers and
    keeps its servers"""
    # How long a lost worker's replacement may take to be placed before the group restarts on fewer workers.
    wait_s: float = Field(60.0, gt=0.0)
    """after losing a worker, how long the launcher waits for a replacement before restarting on fewer workers"""


class TrainConfig(_Frozen):
    launcher: Launcher = Launcher.LOCAL
    """`local` (worker processes on this machine) or `ray` (one Ray actor per task on a Ray cluster; see Training
    on a Ray cluster)"""
    isolation: Isolation = Isolation.PROCESS
    """`process`: every task its own supervised worker process (the watchdog kills and restarts a hung one; a
    crash cannot take the flow down). `none`: one worker (`workers: 1`, no parameter servers, local launcher;
    anything else is refused) trains on a thread of the `train` task's own process, with no second Python
    start and no second TensorFlow import (the demo uses it). Same heartbeat, progress, checkpoints and
    result; but a hang can only be asked to stop at the next step boundary (one that does not stop fails the
    run instead of a restart beside it), SIGTERM and `TFDAG_FAULT` act on processes only, `cpu_replicas` > 1
    needs the CPU split before TensorFlow starts in that process, and the worker's own log lines go to that
    process's log (the console), not through the `train` task's Prefect log (its progress artifact and the
    supervisor's lines still do)"""
    ray: RayConfig = RayConfig()
    """The Ray cluster of train.launcher: ray (also the cluster data.engine: ray converts on)"""
    strategy: Strategy = Strategy.AUTO
    """`default`, `one_device`, `mirrored`, `multi_worker_mirrored`, `parameter_server`, `tpu`, `auto`"""
    cpu_replicas: int | None = Field(None, ge=1)
    """split the CPU into N logical devices (multi-replica runs without GPUs)"""
    workers: int = Field(1, ge=1)
    """tasks of the cluster: with the local launcher, processes on 127.0.0.1 with generated TF_CONFIG"""
    parameter_servers: int = Field(0, ge=0)
    """tasks of the cluster: with the local launcher, processes on 127.0.0.1 with generated TF_CONFIG"""
    per_replica_batch_size: int = Field(32, ge=1)
    """global batch = this × replicas over all workers"""
    base_learning_rate: float = Field(1e-3, gt=0.0)
    """scaled by `lr_scaling`"""
    lr_scaling: LrScaling = LrScaling.LINEAR
    """`linear` (× replicas), `sqrt`, `none`"""
    warmup_steps: int = Field(0, ge=0)
    """linear warm-up to the scaled rate"""
    optimizer: Literal["adam", "sgd"] = "adam"
    """`adam` or `sgd`"""
    epochs: int = Field(100, ge=1)  # the ceiling: early_stopping ends training sooner once it stops improving
    """the ceiling: training ends there unless early stopping ends it sooner; `steps` (total) overrides epochs"""
    steps: int | None = Field(None, ge=1)  # total steps; overrides epochs
    """the ceiling: training ends there unless early stopping ends it sooner; `steps` (total) overrides epochs"""
    steps_per_execution: int = Field(1, ge=1)
    """steps inside one `tf.function`"""
    shuffle: bool = True
    """per-epoch deterministic shuffle"""
    autoshard: AutoShard = AutoShard.AUTO
    """`file`, `data` or `auto` (FILE when files balance over workers)"""
    shuffle_buffer: int = Field(10000, ge=1)
    """per-epoch deterministic shuffle"""
    seed: int = 42
    """seeds (shuffle, dropout, initialisation; parameter-server workers' input order too); `deterministic` turns
    on op determinism, and such a run reproduces bit for bit (see Reproducing a run)"""
    deterministic: bool = False
    """seeds (shuffle, dropout, initialisation; parameter-server workers' input order too); `deterministic` turns
    on op determinism, and such a run reproduces bit for bit (see Reproducing a run)"""
    mixed_precision: bool = False
    """`mixed_float16` policy with loss scaling"""
    jit_compile: bool = False  # XLA for the forward and backward pass of the step
    """XLA for the step's forward and backward pass (the update, which all-reduces across replicas, stays
    outside); MLflow param `jit_compile`; refused before training when the data has string features"""
    checkpoint_every_steps: int = Field(100, ge=1)  # also the evaluation cadence (the chief, on the eval split)
    """checkpoint and evaluation cadence (the chief evaluates each checkpoint on the eval split) and retention
    (the best one is always kept)"""
    keep_checkpoints: int = Field(3, ge=1)
    """checkpoint and evaluation cadence (the chief evaluates each checkpoint on the eval split) and retention
    (the best one is always kept)"""
    log_every_steps: int = Field(50, ge=1)
    """progress line and metric cadence"""
    communication: Collective = Collective.AUTO
    """MultiWorkerMirrored collectives (`auto`, `ring`, `nccl`) and gradient packing"""
    gradient_pack_mb: float = Field(0.0, ge=0.0)  # 0: TensorFlow's default packing
    """MultiWorkerMirrored collectives (`auto`, `ring`, `nccl`) and gradient packing"""
    hang_timeout_s: float = Field(300.0, gt=0.0)
    """watchdog bound while stepping: a worker with no new step this long fences and restarts the group; saving
    and finishing get 3 × this, starting this + 120 s (see Fault tolerance)"""
    max_restarts: int = Field(3, ge=0)
    """restarts of retryable failures, with doubling backoff"""
    restart_backoff_s: float = Field(1.0, ge=0.0)
    """restarts of retryable failures, with doubling backoff"""
    timeout_s: float | None = Field(None, gt=0.0)
    """overall training timeout, owned by the supervisor"""
    warm_start_uri: str | None = None
    """start from these weights"""
    early_stopping: EarlyStoppingConfig = EarlyStoppingConfig()
    """Stop training once the gate metric stops improving on the eval split"""
    # Resize on lost workers (None: off): every attempt keeps the global batch and continues the epoch's order.
    elastic: ElasticConfig | None = None
    """Resize on lost workers (None: off): every attempt keeps the global batch and continues the epoch's order."""

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
