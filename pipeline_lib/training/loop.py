"""The training engine: a custom strategy.run loop over TFRecords under any tf.distribute strategy."""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict

from pipeline_lib.core.errors import TfdagError

logger = logging.getLogger(__name__)


class CheckpointRecord(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    step: int
    path: str  # checkpoint prefix, e.g. <run_dir>/checkpoints/ckpt-300
    metrics: dict[str, float] = {}  # eval metrics measured at this step (eval_loss, eval_accuracy...)


class TrainResult(BaseModel):
    """What the chief reports after training."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    run_dir: str
    strategy: str  # the Strategy value actually used
    strategy_reason: str
    num_workers: int
    num_replicas: int  # num_replicas_in_sync over all workers
    per_replica_batch_size: int
    global_batch_size: int
    base_learning_rate: float
    scaled_learning_rate: float
    lr_scaling: str
    steps_per_epoch: int
    total_steps: int
    final_step: int
    final_loss: float
    checkpoint_dir: str
    checkpoints: tuple[CheckpointRecord, ...]
    tensorboard_dir: str
    num_restarts: int = 0
    examples_per_sec: float = 0.0
    wall_s: float = 0.0
    start_step: int = 0  # the step restored from a checkpoint (0 for a fresh run)
    is_chief: bool = True


# Imported after the result types: checkpoints uses CheckpointRecord.
import keras
import numpy as np
import tensorflow as tf

from pipeline_lib.checkpoints import publish
from pipeline_lib.checkpoints import store as ckpt
from pipeline_lib.cluster.validation import ClusterInfo, cluster_from_env
from pipeline_lib.config import PipelineConfig, Strategy, Task, TrainConfig
from pipeline_lib.data.manifest import Manifest
from pipeline_lib.planning.sharding import AutoShardPolicy, ShardPlan
from pipeline_lib.tracking.mlflow_run import MetricsSink, NullSink
from pipeline_lib.training import input_pipeline, models, staging
from pipeline_lib.training import strategy as strategies

CHECKPOINT_DIR = "checkpoints"
TENSORBOARD_DIR = "tensorboard"
EVAL_BATCH_SIZE = 256


class TrainingError(TfdagError, RuntimeError):
    """Training cannot start or go on; the message names the value, where it came from and the fix."""


class TrainingInterrupted(TfdagError, RuntimeError):
    """A stop was requested (preemption): a checkpoint of `step` was saved; resume from it."""

    def __init__(self, step: int, checkpoint_path: str | None = None):
        super().__init__(f"training stopped at step {step} on request; checkpoint {checkpoint_path} saved")
        self.step = step
        self.checkpoint_path = checkpoint_path


@runtime_checkable
class TrainHooksProtocol(Protocol):
    def on_step_end(self, step: int, examples: int, loss: float) -> None: ...

    def stop_requested(self) -> bool: ...


class TrainHooks:
    """Callbacks the loop calls at step boundaries; the defaults do nothing.

    `on_step_end(step, examples, loss)` gets the global step just finished, the examples of that
    step over all replicas, and its loss. `stop_requested()` is polled between executions; when
    it returns True (on any worker) the loop saves a checkpoint and raises TrainingInterrupted.
    """

    def on_step_end(self, step: int, examples: int, loss: float) -> None:
        pass

    def stop_requested(self) -> bool:
        return False


def epoch_seed(seed: int, epoch: int | tf.Tensor) -> int | tf.Tensor:
    """The shuffle seed of an epoch: a fixed function of (seed, epoch), so a resumed run reshuffles alike.

    `epoch` is an int or, inside the training input pipeline, an int64 tensor: the same value either way. The
    seed's part is reduced in Python first, so a seed of any size never overflows the tensor's int64.
    """
    modulus = 2**31 - 1
    return ((seed * 1_000_003 + 1) % modulus + epoch * 7_919) % modulus


def _epochs(manifest: Manifest, train_config: TrainConfig, batch: int, files: tuple[str, ...] | None,
            shard: tuple[int, int] | None, is_classification: bool, batches_per_epoch: int, start_epoch: int,
            first_skip: int, num_epochs: int) -> tf.data.Dataset:
    """One input pipeline's batches for epochs start_epoch..num_epochs-1 in one dataset, built and traced once.

    Epoch e is `create_dataset` shuffled with `epoch_seed(seed, e)` and cut to `batches_per_epoch`, so a resumed
    run sees the batches an uninterrupted one saw; the first epoch skips the `first_skip` already trained.
    Rebuilding the pipeline for each epoch instead cost about 0.2 s of Python and tracing per epoch, more than
    a small epoch's whole input.
    """

    def epoch_dataset(epoch: tf.Tensor) -> tf.data.Dataset:
        _seedable_in_trace()
        skip = tf.where(epoch == start_epoch, tf.constant(first_skip, tf.int64), tf.constant(0, tf.int64))
        dataset = input_pipeline.create_dataset(
            manifest, "train", batch, files=files, shard=shard, shuffle=train_config.shuffle,
            seed=epoch_seed(train_config.seed, epoch), shuffle_buffer=train_config.shuffle_buffer,
            drop_remainder=True, skip_batches=skip, is_classification=is_classification)
        # Exactly the plan's steps per epoch on every worker: an extra batch on one would hang the all-reduce.
        return dataset.take(batches_per_epoch - skip)

    epochs = tf.data.Dataset.range(start_epoch, num_epochs).flat_map(epoch_dataset)
    return epochs.prefetch(tf.data.AUTOTUNE)  # the next epoch's first batches are ready at its boundary


def _seedable_in_trace() -> None:
    """Let a shuffle seeded by a tensor be built in the function being traced, whatever the global seed.

    tf.data derives an op's seeds with `random_seed.get_seed`, which tests `(graph seed, op seed) == (0, 0)`: with
    a graph seed of 0 (`train.seed: 0` sets the global seed to 0) that asks a traced tensor for its truth value,
    which graph mode refuses. A traced function's graph seed is its own copy of the global seed; setting that
    copy to 1 instead of 0 only changes which fixed shuffle stream a seed-0 run gets (every epoch is built here,
    so a resumed run gets the same one). Other seeds are left alone.
    """
    graph = tf.compat.v1.get_default_graph()
    if graph.seed is not None and graph.seed % (2**31 - 1) == 0:
        graph.seed = 1


def _loss_fn(task: Task) -> Callable[[tf.Tensor, tf.Tensor], tf.Tensor]:
    if task == Task.CLASSIFICATION:
        def per_example(labels, logits):
            return tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=tf.cast(logits, tf.float32))
    else:
        def per_example(labels, logits):
            return tf.square(tf.cast(tf.reshape(logits, [-1]), tf.float32) - labels)
    return per_example


def _create_optimizer(config: PipelineConfig, learning_rate, mixed_precision: bool) -> keras.optimizers.Optimizer:
    if config.train.optimizer == "sgd":
        optimizer = keras.optimizers.SGD(learning_rate=learning_rate)
    else:
        optimizer = keras.optimizers.Adam(learning_rate=learning_rate)
    if mixed_precision:
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    return optimizer


def _build_model(config: PipelineConfig, manifest: Manifest) -> keras.Model:
    if not config.train.mixed_precision:
        return models.create_model(config.model, manifest.feature_schema)
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_float16")
    try:
        return models.create_model(config.model, manifest.feature_schema)
    finally:
        keras.config.set_dtype_policy(previous)


class _Evaluator:
    """Eval metrics on the eval split, computed by the chief alone, outside any replica context.

    Reads of mirrored variables in cross-replica context touch only the local copy, so no collective op
    runs here and the other workers are never waited on.
    """

    def __init__(self, model: keras.Model, manifest: Manifest, task: Task):
        self.task = task
        self.dataset = None
        if manifest.shards_for("eval"):
            self.dataset = input_pipeline.create_dataset(
                manifest, "eval", EVAL_BATCH_SIZE, is_classification=task == Task.CLASSIFICATION)
        loss_fn = _loss_fn(task)

        @tf.function(reduce_retracing=True)
        def batch_sums(inputs, labels):
            logits = tf.cast(model(inputs, training=False), tf.float32)
            loss = tf.reduce_sum(loss_fn(labels, logits))
            if task == Task.CLASSIFICATION:
                hits = tf.reduce_sum(tf.cast(tf.equal(tf.argmax(logits, axis=-1), labels), tf.float32))
            else:
                hits = tf.reduce_sum(tf.abs(tf.reshape(logits, [-1]) - labels))
            return loss, hits, tf.cast(tf.shape(labels)[0], tf.float32)

        self._batch_sums = batch_sums

    def __call__(self) -> dict[str, float]:
        if self.dataset is None:
            return {}
        loss = hits = count = 0.0
        for inputs, labels in self.dataset:
            batch_loss, batch_hits, batch_count = self._batch_sums(inputs, labels)
            loss += float(batch_loss)
            hits += float(batch_hits)
            count += float(batch_count)
        if not count:
            return {}
        metrics = {"eval_loss": loss / count}
        metrics["eval_accuracy" if self.task == Task.CLASSIFICATION else "eval_mae"] = hits / count
        return metrics


def _sync_flag(choice: strategies.StrategyChoice, flag: bool, fn_cache: dict) -> bool:
    """True when `flag` is True on any worker: an all-reduce, so every worker stops at the same step."""
    if choice.num_workers <= 1:
        return flag
    if "fn" not in fn_cache:
        strategy = choice.strategy

        @tf.function
        def any_true(value):
            per_replica = strategy.run(lambda v: tf.identity(v), args=(value,))
            return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

        fn_cache["fn"] = any_true
    return bool(fn_cache["fn"](tf.constant(1.0 if flag else 0.0)).numpy() > 0.5)


def _check_plan(plan: ShardPlan, choice: strategies.StrategyChoice, config: PipelineConfig) -> int:
    global_batch = plan.per_replica_batch_size * choice.num_replicas
    if plan.global_batch_size != global_batch:
        raise TrainingError(
            f"the shard plan's global_batch_size ({plan.global_batch_size}) is not per_replica_batch_size "
            f"({plan.per_replica_batch_size}) × the {choice.num_replicas} replica(s) of strategy "
            f"{choice.kind.value}; re-plan the shards for {choice.num_workers} worker(s) × "
            f"{choice.replicas_per_worker} replica(s)"
        )
    if plan.total_steps < 1 or plan.steps_per_epoch < 1:
        raise TrainingError(
            f"the shard plan has total_steps {plan.total_steps}, steps_per_epoch {plan.steps_per_epoch}; the train "
            f"split is smaller than one global batch of {global_batch}: lower train.per_replica_batch_size"
        )
    if plan.per_replica_batch_size != config.train.per_replica_batch_size:
        logger.warning("shard plan per_replica_batch_size %d differs from train.per_replica_batch_size %d; "
                       "using the plan's", plan.per_replica_batch_size, config.train.per_replica_batch_size)
    return global_batch


def _pipeline_data(plan: ShardPlan, pipeline_id: int, num_pipelines: int) -> tuple[tuple[str, ...] | None,
                                                                                    tuple[int, int] | None]:
    """The files and record shard one input pipeline reads under the plan's policy."""
    if plan.policy == AutoShardPolicy.FILE:
        return plan.files_for(pipeline_id), None
    # DATA: every pipeline reads every file and keeps every num_pipelines-th record, so that global batch k
    # is records [k·B, (k+1)·B) whatever the split of B into workers and replicas.
    return None, (num_pipelines, pipeline_id) if num_pipelines > 1 else None


def train(
    config: PipelineConfig,
    manifest: Manifest,
    plan: ShardPlan,
    run_dir: str,
    *,
    cluster: ClusterInfo | None = None,
    metrics_sink: MetricsSink | None = None,
    hooks: TrainHooks | None = None,
    strategy_choice: strategies.StrategyChoice | None = None,
) -> TrainResult:
    """Train the configured model on the plan's shards under the configured strategy.

    Every worker runs exactly `plan.total_steps` steps in total, counting the steps restored from
    the newest valid checkpoint in `<run_dir>/checkpoints`. A dataset on remote storage is first staged:
    each worker copies only the shards its plan assigns it to a verified local cache (`staging`).

    Args:
        config: the pipeline config (model, train, evaluation sections are used).
        manifest: the dataset manifest.
        plan: the shard plan for this cluster.
        run_dir: where checkpoints and TensorBoard logs go: a local path, or any fsspec URI (`s3://...`),
            which TensorFlow writes to a local mirror first and the chief publishes (see `publish.RunStorage`).
        cluster: this process's cluster value; default parsed from TF_CONFIG.
        metrics_sink: where the chief logs metrics; default discards them.
        hooks: step callbacks (heartbeats, fault injection, preemption).
        strategy_choice: a strategy already built in this process; default built from the config.

    Returns:
        The TrainResult (on every worker; only the chief's lists checkpoints).

    Raises:
        TrainingError: when the plan does not fit the strategy or the data cannot feed the plan.
        TrainingInterrupted: when `hooks.stop_requested()` turned True; a checkpoint was saved first.
    """
    started = time.perf_counter()
    train_config = config.train
    cluster = cluster if cluster is not None else cluster_from_env()
    hooks = hooks if hooks is not None else TrainHooks()
    if strategy_choice is None:
        strategies.configure_devices(train_config)
        strategy_choice = strategies.create_strategy(train_config, cluster)
    is_chief = cluster.is_chief
    sink = metrics_sink if (metrics_sink is not None and is_chief) else NullSink()
    if train_config.deterministic:
        keras.utils.set_random_seed(train_config.seed)
        tf.config.experimental.enable_op_determinism()
    elif train_config.seed is not None:
        keras.utils.set_random_seed(train_config.seed)
    if staging.needs_staging(manifest):
        # tf.data reads local files only; under parameter_server the coordinator's datasets read every file.
        manifest = staging.stage_for_worker(
            manifest, None if strategy_choice.kind == Strategy.PARAMETER_SERVER else plan, cluster,
            storage_options=config.storage_options)
    if strategy_choice.kind == Strategy.PARAMETER_SERVER:
        return _train_parameter_server(config, manifest, plan, run_dir, cluster, sink, hooks, strategy_choice,
                                       started)
    return _train_synchronous(config, manifest, plan, run_dir, cluster, sink, hooks, strategy_choice, started)


def _create_state(config: PipelineConfig, manifest: Manifest, choice: strategies.StrategyChoice):
    with choice.strategy.scope():
        model = _build_model(config, manifest)
        learning_rate = strategies.create_learning_rate(config.train, choice.num_replicas)
        optimizer = _create_optimizer(config, learning_rate, config.train.mixed_precision)
        # Built now, not on the first apply, so a restore finds every slot variable to fill.
        optimizer.build(model.trainable_variables)
        step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step",
                           aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
        # Keras does not checkpoint the dropout seed-generator states with the model; an exact resume
        # needs them, so they ride along under their own key (model-only restores ignore it).
        rng_states = [v.value for v in model.variables if v.path.endswith("seed_generator_state")]
        checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer, step=step, rng=rng_states)
    return model, optimizer, step, checkpoint


def _restore(store: ckpt.CheckpointStore, checkpoint: tf.train.Checkpoint, model: keras.Model,
             choice: strategies.StrategyChoice, config: PipelineConfig, run_storage: publish.RunStorage) -> int:
    # A remote run resumes from what the chief published, the same on every worker.
    run_storage.prepare_restore()
    # Checkpoint restoring should be inside scope (b/139450638).
    with choice.strategy.scope():
        record = store.restore_latest()
        if record is not None:
            return int(checkpoint.step.numpy())
        if config.train.warm_start_uri:
            tf.train.Checkpoint(model=model).read(config.train.warm_start_uri).assert_existing_objects_matched()
            logger.info("warm start: model weights from %s", config.train.warm_start_uri)
    return 0


def _current_lr(optimizer) -> float:
    try:
        return float(np.asarray(optimizer.learning_rate))
    except (TypeError, ValueError):
        return float("nan")


def _run_storage(run_dir: str, cluster: ClusterInfo, config: PipelineConfig) -> publish.RunStorage:
    return publish.RunStorage(run_dir, cluster, config.storage_options, checkpoint_subdir=CHECKPOINT_DIR,
                              tensorboard_subdir=TENSORBOARD_DIR)


def _sync_logs(run_storage: publish.RunStorage, progress: _Progress | None) -> None:
    """Chief of a remote run: flush the summary writer and upload the TensorBoard files that changed."""
    if run_storage.tensorboard_sync is None:
        return
    if progress is not None and progress.writer is not None:
        progress.writer.flush()
    run_storage.sync_tensorboard()


def _publish(run_storage: publish.RunStorage, progress: _Progress, record: ckpt.CheckpointRecord | None,
             keep: int, best_metric: str, best_mode: str) -> None:
    """Chief of a remote run: upload the checkpoint just saved (manifest last), then its TensorBoard logs."""
    if record is None or not run_storage.is_remote:
        return
    if progress.writer is not None:
        progress.writer.flush()
    run_storage.publish_checkpoint(record, keep=keep, best_metric=best_metric, best_mode=best_mode)


class _Progress:
    """The chief's progress line, TensorBoard scalars and sink metrics at each logged step."""

    def __init__(self, is_chief: bool, tensorboard_dir: str, sink: MetricsSink, global_batch: int, step: int):
        self.is_chief = is_chief
        self.sink = sink
        self.global_batch = global_batch
        self.writer = tf.summary.create_file_writer(tensorboard_dir) if is_chief else None
        self.last_step = step
        self.last_time = time.perf_counter()
        self.total_steps = 0
        self.total_time = 0.0

    def log(self, step: int, loss: float, learning_rate: float) -> None:
        now = time.perf_counter()
        elapsed = max(now - self.last_time, 1e-9)
        steps = step - self.last_step
        self.total_steps += steps
        self.total_time += elapsed
        self.last_step, self.last_time = step, now
        if not self.is_chief:
            return
        steps_per_sec = steps / elapsed
        examples_per_sec = steps_per_sec * self.global_batch
        logger.info("train | step: %6d | steps/sec: %.1f | examples/sec: %.0f | loss: %.4f",
                    step, steps_per_sec, examples_per_sec, loss)
        with self.writer.as_default(step=step):
            tf.summary.scalar("loss", loss)
            tf.summary.scalar("learning_rate", learning_rate)
            tf.summary.scalar("examples_per_sec", examples_per_sec)
        self.sink.log_metrics({"loss": loss, "learning_rate": learning_rate, "steps_per_sec": steps_per_sec,
                               "examples_per_sec": examples_per_sec}, step=step)

    def log_eval(self, step: int, metrics: dict[str, float]) -> None:
        if not self.is_chief or not metrics:
            return
        with self.writer.as_default(step=step):
            for name, value in metrics.items():
                tf.summary.scalar(name, value)
        self.sink.log_metrics(metrics, step=step)

    @property
    def examples_per_sec(self) -> float:
        return self.total_steps * self.global_batch / self.total_time if self.total_time else 0.0

    def close(self) -> None:
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
        self.sink.flush()


class _Boundaries:
    """What both training loops do between executions: bound each run of steps by the next log, checkpoint and
    the end, then call the step hooks, log, checkpoint and honour a stop request; `finish` saves the last step.

    A checkpoint evaluates (chief) and publishes after `store.save`; `before_save` runs first (the parameter
    server coordinator's join, so the saved variables hold every scheduled step).
    """

    def __init__(self, train_config: TrainConfig, total_steps: int, start_step: int, global_batch: int,
                 hooks: TrainHooksProtocol, progress: _Progress, optimizer, store: ckpt.CheckpointStore,
                 step_var: tf.Variable, evaluate: Callable[[], dict[str, float]] | None,
                 run_storage: publish.RunStorage, best_metric: str, best_mode: str,
                 before_save: Callable[[], None] | None = None):
        self.config, self.total_steps, self.global_batch = train_config, total_steps, global_batch
        self.hooks, self.progress, self.optimizer = hooks, progress, optimizer
        self.store, self.step_var, self.evaluate, self.run_storage = store, step_var, evaluate, run_storage
        self.best_metric, self.best_mode, self.before_save = best_metric, best_mode, before_save
        self.step, self.last_loss = start_step, float("nan")
        self._last_saved = start_step if start_step else -1

    def steps_to_next(self, limit: int) -> int:
        """Steps to run next: at most `limit`, and none past the next log or checkpoint step or the end."""
        log_every, save_every = self.config.log_every_steps, self.config.checkpoint_every_steps
        return min(limit, self.total_steps - self.step, log_every - self.step % log_every,
                   save_every - self.step % save_every)

    def after(self, losses: Sequence[float], stop_requested: Callable[[], bool]) -> None:
        """Account for `losses`, one per step just run; raises TrainingInterrupted on a stop request."""
        for offset, loss in enumerate(losses):
            self.hooks.on_step_end(self.step + offset + 1, self.global_batch, float(loss))
        self.step += len(losses)
        self.last_loss = float(losses[-1])
        if not math.isfinite(self.last_loss):
            logger.warning("loss is %s at step %d", self.last_loss, self.step)
        step = self.step
        if step % self.config.log_every_steps == 0 or step == self.total_steps:
            self.progress.log(step, self.last_loss, _current_lr(self.optimizer))
            _sync_logs(self.run_storage, self.progress)
        if step % self.config.checkpoint_every_steps == 0 or step == self.total_steps:
            self._save(step)
        if step < self.total_steps and stop_requested():
            record = self._save(step) if self._last_saved != step else None
            raise TrainingInterrupted(step, record.path if record is not None else
                                      ckpt.prefix_for(self.run_storage.local_checkpoint_dir, step))

    def finish(self) -> None:
        if self._last_saved != self.step:
            self._save(self.step)

    def _save(self, at_step: int) -> ckpt.CheckpointRecord | None:
        if self.before_save is not None:
            self.before_save()
        self.step_var.assign(at_step)

        def measure() -> dict[str, float]:
            metrics = self.evaluate() if self.evaluate is not None else {}
            self.progress.log_eval(at_step, metrics)
            return metrics

        record = self.store.save(at_step, metrics_fn=measure)
        _publish(self.run_storage, self.progress, record, self.config.keep_checkpoints, self.best_metric,
                 self.best_mode)
        self._last_saved = at_step
        return record


def _train_synchronous(config, manifest, plan, run_dir, cluster, sink, hooks, choice, started) -> TrainResult:
    train_config = config.train
    strategy = choice.strategy
    global_batch = _check_plan(plan, choice, config)
    is_classification = config.model.task == Task.CLASSIFICATION
    run_storage = _run_storage(run_dir, cluster, config)
    checkpoint_dir = run_storage.local_checkpoint_dir
    tensorboard_dir = run_storage.local_tensorboard_dir
    model, optimizer, step_var, checkpoint = _create_state(config, manifest, choice)
    best_metric, best_direction = ckpt.selection_metric(config)
    best_mode = best_direction.value
    store = ckpt.CheckpointStore(checkpoint_dir, checkpoint, cluster=cluster, keep=train_config.keep_checkpoints,
                                 best_metric=best_metric, best_mode=best_mode)
    start_step = _restore(store, checkpoint, model, choice, config, run_storage)
    total_steps, steps_per_epoch = plan.total_steps, plan.steps_per_epoch
    if start_step > total_steps:
        raise TrainingError(f"the checkpoint in {checkpoint_dir} is at step {start_step}, past the plan's "
                            f"total_steps ({total_steps}); use a fresh run_dir or raise train.steps")
    if start_step:
        logger.info("resuming at step %d of %d", start_step, total_steps)

    per_example_loss = _loss_fn(config.model.task)
    mixed = train_config.mixed_precision
    per_replica_batch = plan.per_replica_batch_size

    num_epochs = -(-total_steps // steps_per_epoch)
    start_epoch, start_position = divmod(start_step, steps_per_epoch)

    def dataset_fn(input_context: tf.distribute.InputContext) -> tf.data.Dataset:
        batch = input_context.get_per_replica_batch_size(global_batch)
        num_pipelines, pipeline_id = input_context.num_input_pipelines, input_context.input_pipeline_id
        replicas_per_pipeline = max(1, choice.num_replicas // num_pipelines)
        files, shard = _pipeline_data(plan, pipeline_id, num_pipelines)
        needed = steps_per_epoch * replicas_per_pipeline
        available = input_pipeline.num_shard_records(manifest, "train", files, shard) // batch
        if available < needed:
            raise TrainingError(
                f"input pipeline {pipeline_id} of {num_pipelines} holds {available} batches of {batch} per epoch "
                f"but the shard plan needs {needed} ({steps_per_epoch} steps × {replicas_per_pipeline} replicas); "
                "re-plan the shards for this cluster"
            )
        return _epochs(manifest, train_config, batch, files, shard, is_classification, needed,
                       start_epoch, start_position * replicas_per_pipeline, num_epochs)

    def step_fn(inputs, labels):
        with tf.GradientTape() as tape:
            logits = model(inputs, training=True)
            loss = tf.nn.compute_average_loss(per_example_loss(labels, logits), global_batch_size=global_batch)
            if model.losses:
                loss += tf.nn.scale_regularization_loss(tf.add_n(model.losses))
            scaled = optimizer.scale_loss(loss) if mixed else loss
        gradients = tape.gradient(scaled, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        return loss

    @tf.function
    def run_steps(iterator, num_steps):
        losses = tf.TensorArray(tf.float32, size=num_steps)
        for i in tf.range(num_steps):
            inputs, labels = next(iterator)
            per_replica_loss = strategy.run(step_fn, args=(inputs, labels))
            losses = losses.write(i, strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica_loss, axis=None))
        return losses.stack()

    evaluate = _Evaluator(model, manifest, config.model.task) if cluster.is_chief else None
    progress = _Progress(cluster.is_chief, tensorboard_dir, sink, global_batch, start_step)
    flag_cache: dict[str, Any] = {}
    bounds = _Boundaries(train_config, total_steps, start_step, global_batch, hooks, progress, optimizer, store,
                         step_var, evaluate, run_storage, best_metric, best_mode)

    def stop_requested() -> bool:
        return _sync_flag(choice, bool(hooks.stop_requested()), flag_cache)

    try:
        iterator = iter(strategy.distribute_datasets_from_function(dataset_fn))
        while bounds.step < total_steps:
            # An execution also ends with its epoch.
            count = bounds.steps_to_next(min(train_config.steps_per_execution,
                                             steps_per_epoch - bounds.step % steps_per_epoch))
            bounds.after(run_steps(iterator, tf.constant(count, tf.int32)).numpy(), stop_requested)
        bounds.finish()
    finally:
        progress.close()
        _sync_logs(run_storage, None)

    records = run_storage.checkpoint_records() if cluster.is_chief else ()
    return TrainResult(
        run_dir=run_dir,
        strategy=choice.kind.value,
        strategy_reason=choice.reason,
        num_workers=choice.num_workers,
        num_replicas=choice.num_replicas,
        per_replica_batch_size=per_replica_batch,
        global_batch_size=global_batch,
        base_learning_rate=train_config.base_learning_rate,
        scaled_learning_rate=strategies.scaled_learning_rate(
            train_config.base_learning_rate, train_config.lr_scaling, choice.num_replicas),
        lr_scaling=train_config.lr_scaling.value,
        steps_per_epoch=steps_per_epoch,
        total_steps=total_steps,
        final_step=bounds.step,
        final_loss=bounds.last_loss,
        checkpoint_dir=run_storage.checkpoint_dir,
        checkpoints=records,
        tensorboard_dir=run_storage.tensorboard_dir,
        examples_per_sec=progress.examples_per_sec,
        wall_s=time.perf_counter() - started,
        start_step=start_step,
        is_chief=cluster.is_chief,
    )


def _train_parameter_server(config, manifest, plan, run_dir, cluster, sink, hooks, choice, started) -> TrainResult:
    """The chief-side (coordinator) loop: per-worker datasets, scheduled steps, asynchronous updates."""
    train_config = config.train
    strategy = choice.strategy
    if not cluster.is_chief:
        raise TrainingError(
            f"{cluster.name} called train() under parameter_server; only the chief coordinates; run "
            "training.run_server(cluster) on worker and ps tasks"
        )
    if train_config.deterministic:
        logger.warning("train.deterministic under parameter_server: updates are asynchronous, so runs differ")
    per_replica_batch = plan.per_replica_batch_size
    # Each scheduled step runs on one worker; its batch is that worker's replicas.
    global_batch = per_replica_batch * choice.num_replicas
    is_classification = config.model.task == Task.CLASSIFICATION
    run_storage = _run_storage(run_dir, cluster, config)
    checkpoint_dir = run_storage.local_checkpoint_dir
    tensorboard_dir = run_storage.local_tensorboard_dir
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    model, optimizer, step_var, checkpoint = _create_state(config, manifest, choice)
    best_metric, best_direction = ckpt.selection_metric(config)
    best_mode = best_direction.value
    store = ckpt.CheckpointStore(checkpoint_dir, checkpoint, cluster=cluster, keep=train_config.keep_checkpoints,
                                 best_metric=best_metric, best_mode=best_mode)
    start_step = _restore(store, checkpoint, model, choice, config, run_storage)
    total_steps = plan.total_steps
    per_example_loss = _loss_fn(config.model.task)
    mixed = train_config.mixed_precision

    def dataset_fn(input_context: tf.distribute.InputContext) -> tf.data.Dataset:
        batch = input_context.get_per_replica_batch_size(global_batch)
        # Workers train asynchronously on their own shuffles of the whole split.
        return input_pipeline.create_dataset(
            manifest, "train", batch, shuffle=True, seed=None, shuffle_buffer=train_config.shuffle_buffer,
            repeat=True, drop_remainder=True, is_classification=is_classification)

    @tf.function
    def per_worker_dataset_fn():
        return strategy.distribute_datasets_from_function(dataset_fn)

    per_worker_iterator = iter(coordinator.create_per_worker_dataset(per_worker_dataset_fn))

    @tf.function
    def worker_fn(iterator):
        def replica_fn(inputs, labels):
            with tf.GradientTape() as tape:
                logits = model(inputs, training=True)
                loss = tf.nn.compute_average_loss(per_example_loss(labels, logits), global_batch_size=global_batch)
                if model.losses:
                    loss += tf.nn.scale_regularization_loss(tf.add_n(model.losses))
                scaled = optimizer.scale_loss(loss) if mixed else loss
            gradients = tape.gradient(scaled, model.trainable_variables)
            optimizer.apply_gradients(zip(gradients, model.trainable_variables))
            return loss

        inputs, labels = next(iterator)
        losses = strategy.run(replica_fn, args=(inputs, labels))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)

    evaluate = _Evaluator(model, manifest, config.model.task)
    progress = _Progress(True, tensorboard_dir, sink, global_batch, start_step)
    bounds = _Boundaries(train_config, total_steps, start_step, global_batch, hooks, progress, optimizer, store,
                         step_var, evaluate, run_storage, best_metric, best_mode, before_save=coordinator.join)

    try:
        while bounds.step < total_steps:
            count = bounds.steps_to_next(total_steps)
            results = [coordinator.schedule(worker_fn, args=(per_worker_iterator,)) for _ in range(count)]
            coordinator.join()
            bounds.after([float(r.fetch()) for r in results], hooks.stop_requested)
        bounds.finish()
    finally:
        progress.close()
        _sync_logs(run_storage, None)

    return TrainResult(
        run_dir=run_dir, strategy=choice.kind.value, strategy_reason=choice.reason, num_workers=choice.num_workers,
        num_replicas=choice.num_replicas, per_replica_batch_size=per_replica_batch, global_batch_size=global_batch,
        base_learning_rate=train_config.base_learning_rate,
        scaled_learning_rate=strategies.scaled_learning_rate(
            train_config.base_learning_rate, train_config.lr_scaling, choice.num_replicas),
        lr_scaling=train_config.lr_scaling.value, steps_per_epoch=plan.steps_per_epoch, total_steps=total_steps,
        final_step=bounds.step, final_loss=bounds.last_loss, checkpoint_dir=run_storage.checkpoint_dir,
        checkpoints=run_storage.checkpoint_records(), tensorboard_dir=run_storage.tensorboard_dir,
        examples_per_sec=progress.examples_per_sec, wall_s=time.perf_counter() - started, start_step=start_step,
    )


def run_server(cluster: ClusterInfo) -> None:
    """Serve a ps or worker task of a parameter-server cluster until the process is killed.

    Raises:
        TrainingError: when the task is not a ps or worker of a cluster.
    """
    if cluster.task_type not in ("ps", "worker") or not cluster.cluster:
        raise TrainingError(
            f"run_server needs a TF_CONFIG ps or worker task, got {cluster.name!r} with cluster "
            f"{sorted(cluster.cluster)}; the chief runs train() instead"
        )
    # Workers keep going when a ps is briefly unreachable; the coordinator decides what fails.
    os.environ.setdefault("GRPC_FAIL_FAST", "use_caller")
    server = tf.distribute.Server(
        tf.train.ClusterSpec({job: list(addresses) for job, addresses in cluster.cluster.items()}),
        job_name=cluster.task_type, task_index=cluster.task_index, protocol="grpc", start=True)
    logger.info("%s serving on %s", cluster.name, cluster.cluster[cluster.task_type][cluster.task_index])
    server.join()
