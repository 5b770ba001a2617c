"""The training loop: `train()` over TFRecords under any tf.distribute strategy, and `run_server` for ps tasks.

Synchronous strategies run several steps per `tf.function` call on every worker; under parameter_server the
chief coordinates, scheduling one step at a time on the workers. Both share the setup (`setup`), the step
function (`step`) and the work between executions (`controller`).
"""

from __future__ import annotations

import logging
import math
import os
import time

import numpy as np
import tensorflow as tf

from pipeline_lib.checkpoints.records import TRAIN_LOSS_METRIC
from pipeline_lib.cluster.info import ClusterInfo, cluster_from_env
from pipeline_lib.config import PipelineConfig, Strategy, Task
from pipeline_lib.data.manifest import Manifest
from pipeline_lib.planning.sharding import ShardPlan
from pipeline_lib.training import elastic, epochs, input_pipeline, staging
from pipeline_lib.training import strategy as strategies
from pipeline_lib.training.actions.base import LoopAction
from pipeline_lib.training.actions.coordinator import JoinCoordinator
from pipeline_lib.training.actions.early_stopping import StopEarly
from pipeline_lib.training.actions.preemption import SaveCheckpointIfPreempted
from pipeline_lib.training.actions.profiling import ProfileWindow
from pipeline_lib.training.actions.pruning import PruneTrial
from pipeline_lib.training.actions.tensorboard import UploadTensorBoard
from pipeline_lib.training.agreement import StopAgreement
from pipeline_lib.training.controller import LoopController
from pipeline_lib.training.early_stopping import EarlyStopping, StopRule
from pipeline_lib.training.errors import TrainingError
from pipeline_lib.training.evaluator import Evaluator
from pipeline_lib.training.hooks import MetricsSink, NullSink, TrainHooks
from pipeline_lib.training.progress import ProgressLogger
from pipeline_lib.training.results import TrainResult
from pipeline_lib.training.setup import (
    TrainingState,
    batch_for_strategy,
    create_training_state,
    op_determinism_enabled,
    seed_everything,
)
from pipeline_lib.training.step import StepOutputs, create_train_step

logger = logging.getLogger(__name__)


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
    stop_rule: StopRule | None = None,
) -> TrainResult:
    """Train the configured model on the plan's shards under the configured strategy.

    Every worker runs `plan.total_steps` steps in total (fewer after an early stop), counting the steps restored from
    the newest valid checkpoint in `<run_dir>/checkpoints`. A dataset on remote storage is first staged:
    each worker copies only the shards its plan assigns it to a verified local cache (`staging`).

    Args:
        config: the pipeline config (model, train, evaluation sections are used).
        manifest: the dataset manifest.
        plan: the shard plan for this cluster.
        run_dir: where checkpoints and TensorBoard logs go: a local path, or any fsspec URI (`s3://...`),
            which TensorFlow writes to a local mirror first and the chief publishes (see `run_storage.RunStorage`).
        cluster: this process's cluster value; default parsed from TF_CONFIG.
        metrics_sink: where the chief logs metrics; default discards them.
        hooks: step callbacks (heartbeats, fault injection, preemption).
        strategy_choice: a strategy already built in this process; default built from the config.
        stop_rule: a rule the chief applies at each evaluation besides early stopping (a tuning trial's pruner,
            `tuning.pruning`); its stop ends training at an agreed step like an early stop. Only the chief's counts.

    Returns:
        The TrainResult (on every worker; only the chief's lists checkpoints).

    Raises:
        TrainingError: when the plan does not fit the strategy or the data cannot feed the plan.
        TrainingInterrupted: when `hooks.stop_requested()` turned True; a checkpoint was saved first.

    Training ends before `plan.total_steps` when `train.early_stopping` runs out of patience at an evaluation: the
    chief decides and every worker leaves at that step (`agreement`); the result says where and why.
    """
    started = time.perf_counter()
    train_config = config.train
    cluster = cluster if cluster is not None else cluster_from_env()
    hooks = hooks if hooks is not None else TrainHooks()
    _check_jit_compile(train_config.jit_compile, manifest)  # before any strategy joins a cluster
    if strategy_choice is None:
        strategies.configure_devices(train_config)
        strategy_choice = strategies.create_strategy(train_config, cluster)
    choice = strategy_choice
    sink = metrics_sink if (metrics_sink is not None and cluster.is_chief) else NullSink()
    seed_everything(train_config)
    is_parameter_server = choice.kind == Strategy.PARAMETER_SERVER
    if staging.needs_staging(manifest):
        # tf.data reads local files only; under parameter_server the coordinator's datasets read every file.
        manifest = staging.stage_for_worker(manifest, None if is_parameter_server else plan, cluster,
                                            storage_options=config.storage_options)
    is_classification = config.model.task == Task.CLASSIFICATION
    coordinator = None
    attempt = None  # an elastic run's attempt: its size from the cluster, its global batch from the plan
    if train_config.elastic is not None:
        attempt = elastic.create_attempt(plan, train_config, choice.num_workers, choice.replicas_per_worker,
                                         parameter_server=is_parameter_server)
    if is_parameter_server:
        _check_coordinator(cluster, config)
        coordinator = tf.distribute.coordinator.ClusterCoordinator(choice.strategy)
    # The attempt's batches and learning rate, which everything below reads.
    batch = attempt if attempt is not None else batch_for_strategy(plan, choice, config)
    state = create_training_state(config, manifest, plan, run_dir, cluster, choice, batch)
    if attempt is not None:
        batch = attempt = elastic.resume(attempt, state.restored, state.start_step)
        logger.info("%s", attempt.describe())
    hooks.on_restored(state.start_step)
    step_metrics = config.observability.step_metrics
    # Op determinism refuses the clock op that times the wait for input.
    measure_input_wait = step_metrics and not op_determinism_enabled()
    if step_metrics and not measure_input_wait:
        logger.info("input wait not measured: TensorFlow's op determinism (train.deterministic) refuses its clock op")
    global_batch = batch.global_batch
    train_step = create_train_step(choice.strategy, state.model, state.optimizer, config.model.task, global_batch,
                                   train_config.mixed_precision, train_config.jit_compile, measure_input_wait,
                                   measure_gradient_norm=step_metrics)
    evaluate = Evaluator(state.model, manifest, config.model.task) if cluster.is_chief else None
    progress = ProgressLogger(cluster.is_chief, state.run_storage.local_tensorboard_dir, sink, global_batch,
                              state.start_step)
    early_stopping = EarlyStopping.for_config(config, state.patience)
    actions = _create_actions(config, cluster, state, progress, early_stopping, stop_rule, coordinator)
    controller = LoopController(train_config, plan.total_steps, batch, state, hooks, progress, evaluate, actions)
    try:
        try:
            if attempt is not None and coordinator is not None:
                batches = epochs.create_elastic_coordinator_batches(manifest, train_config, attempt, plan.total_steps,
                                                                    is_classification, hooks.input_batches)
                _run_parameter_server(choice, coordinator, batches, train_step, controller, hooks, plan)
            elif attempt is not None:
                dataset_fn = epochs.create_elastic_dataset_fn(manifest, train_config, attempt, plan.total_steps,
                                                              is_classification, hooks.input_batches)
                _run_synchronous(choice, dataset_fn, train_step, controller, hooks, plan)
            elif coordinator is None:
                dataset_fn = epochs.create_synchronous_dataset_fn(manifest, plan, train_config, choice.num_replicas,
                                                                  global_batch, state.start_step, is_classification,
                                                                  hooks.input_batches)
                _run_synchronous(choice, dataset_fn, train_step, controller, hooks, plan)
            else:
                dataset_fn = epochs.create_parameter_server_dataset_fn(manifest, train_config, global_batch,
                                                                       is_classification)
                _run_parameter_server(choice, coordinator, dataset_fn, train_step, controller, hooks, plan)
        except tf.errors.InvalidArgumentError as error:
            if train_config.jit_compile and "XLA" in str(error):
                raise TrainingError(
                    f"train.jit_compile is on but XLA cannot compile the model's step: {_first_line(error)}; set "
                    "train.jit_compile: false, or replace the op XLA has no kernel for in the model factory"
                ) from error
            raise
        controller.finish()
    finally:
        controller.close()

    _check_final_loss(controller, state)
    run_storage = state.run_storage
    early_stop = controller.early_stop
    pruned = early_stop is not None and early_stop.pruned
    return TrainResult(
        run_dir=run_dir,
        strategy=choice.kind.value,
        strategy_reason=choice.reason,
        num_workers=choice.num_workers,
        num_replicas=choice.num_replicas,
        per_replica_batch_size=batch.per_replica_batch,
        global_batch_size=batch.global_batch,
        base_learning_rate=train_config.base_learning_rate,
        scaled_learning_rate=batch.learning_rate,
        lr_scaling=train_config.lr_scaling.value,
        steps_per_epoch=plan.steps_per_epoch,
        total_steps=plan.total_steps,
        final_step=controller.step,
        final_loss=controller.last_loss,
        checkpoint_dir=run_storage.checkpoint_dir,
        checkpoints=run_storage.checkpoint_records() if cluster.is_chief else (),
        tensorboard_dir=run_storage.tensorboard_dir,
        examples_per_sec=progress.examples_per_sec,
        wall_s=time.perf_counter() - started,
        start_step=state.start_step,
        is_chief=cluster.is_chief,
        early_stopping_metric=early_stopping.metric if train_config.early_stopping.enabled else None,
        stopped_early=early_stop is not None and not pruned,
        stopped_at_step=controller.step if early_stop is not None else None,
        best_step=early_stop.best_step if early_stop is not None else early_stopping.best_step,
        stop_reason=early_stop.reason if early_stop is not None else early_stopping.ceiling_reason(plan.total_steps),
        pruned=pruned,
    )


def _create_actions(config: PipelineConfig, cluster: ClusterInfo, state: TrainingState, progress: ProgressLogger,
                    early_stopping: EarlyStopping, stop_rule: StopRule | None, coordinator) -> list[LoopAction]:
    """The loop's actions, in the order the controller runs them: patience before a pruner, so a trial that would
    have stopped anyway is not counted as pruned; the profile window before the TensorBoard upload, so the last
    upload holds the trace."""
    actions: list[LoopAction] = [SaveCheckpointIfPreempted(), StopEarly(early_stopping)]
    if stop_rule is not None and cluster.is_chief:  # only the chief's rule counts
        actions.append(PruneTrial(stop_rule))
    window = config.observability.profile_steps
    if window is not None and cluster.is_chief:
        actions.append(ProfileWindow(window[0], window[1], state.run_storage.local_tensorboard_dir))
    if state.run_storage.tensorboard_sync is not None:  # a remote run's chief
        actions.append(UploadTensorBoard(progress, state.run_storage))
    if coordinator is not None:
        actions.append(JoinCoordinator(coordinator))
    return actions


def _check_jit_compile(jit_compile: bool, manifest: Manifest) -> None:
    """XLA compiles numeric tensors only: string features (hashed inside the model) cannot go through it."""
    strings = [spec.name for spec in input_pipeline.string_features(manifest.feature_schema)]
    if jit_compile and strings:
        raise TrainingError(
            f"train.jit_compile is on but the data has string feature(s) {strings}, which XLA cannot compile "
            "(the model hashes them in the step); set train.jit_compile: false, or convert those columns to numbers"
        )


def _first_line(error: Exception) -> str:
    lines = [line.strip() for line in str(error).splitlines() if "XLA" in line]
    return (lines[0] if lines else str(error).strip().splitlines()[0])[:300]


def _check_final_loss(controller: LoopController, state: TrainingState) -> None:
    """A run restored at its final step trains nothing and reports its checkpoint's train loss.

    Raises:
        TrainingError: naming the checkpoint when it recorded no train loss (saved by an older tfdag).
    """
    if state.restored is None or controller.step != state.start_step or math.isfinite(controller.last_loss):
        return
    raise TrainingError(
        f"the run resumed at its final step from checkpoint {state.restored.path}, whose manifest records no "
        f"{TRAIN_LOSS_METRIC} to report as the final loss (saved by an older tfdag); raise train.steps to train on "
        "from it, or use a fresh run_dir")


def _check_coordinator(cluster: ClusterInfo, config: PipelineConfig) -> None:
    """Under parameter_server only the chief runs train(); asynchronous updates are never deterministic."""
    if not cluster.is_chief:
        raise TrainingError(
            f"{cluster.name} called train() under parameter_server; only the chief coordinates; run "
            "training.run_server(cluster) on worker and ps tasks"
        )
    if config.train.deterministic:
        logger.warning("train.deterministic under parameter_server: updates are asynchronous, so runs differ")


def _run_synchronous(choice: strategies.StrategyChoice, dataset_fn: epochs.DatasetFn, train_step,
                     controller: LoopController, hooks: TrainHooks, plan: ShardPlan) -> None:
    """Every worker runs the same steps in lockstep, up to steps_per_execution in one `tf.function` call."""
    strategy = choice.strategy
    steps_per_epoch, steps_per_execution = plan.steps_per_epoch, controller.config.steps_per_execution

    @tf.function
    def run_steps(iterator, num_steps):
        # The iterations run in order (each one's outputs wait for all its stateful ops), so a step's input wait
        # starts after the previous step is done.
        outputs = StepOutputs(*(tf.TensorArray(tf.float32, size=num_steps) for _ in StepOutputs._fields))
        for i in tf.range(num_steps):
            step = train_step(iterator)
            outputs = StepOutputs(*(array.write(i, value) for array, value in zip(outputs, step)))
        return StepOutputs(*(array.stack() for array in outputs))

    agree = StopAgreement(choice, hooks)
    iterator = iter(strategy.distribute_datasets_from_function(dataset_fn))
    try:
        while not controller.is_done:
            # An execution also ends with its epoch.
            count = controller.steps_to_next(min(steps_per_execution,
                                                 steps_per_epoch - controller.step % steps_per_epoch))
            outputs = run_steps(iterator, tf.constant(count, tf.int32))
            controller.after_execution(StepOutputs(*(values.numpy() for values in outputs)), agree)
    finally:
        hooks.input_done(iterator)


class _OneBatch:
    """The "iterator" of a step whose batch the coordinator shipped with it: `next` gives that batch."""

    def __init__(self, batch):
        self.batch = batch

    def __next__(self):
        return self.batch


def _run_parameter_server(choice: strategies.StrategyChoice, coordinator, inputs: epochs.DatasetFn | tf.data.Dataset,
                          train_step, controller: LoopController, hooks: TrainHooks, plan: ShardPlan) -> None:
    """The chief (coordinator) schedules single steps on the workers, which update the ps asynchronously.

    `inputs` is a `dataset_fn` (each worker reads its own dataset) or, for an elastic run, the coordinator's own
    batches, one shipped with each step in order (`epochs.create_elastic_coordinator_batches`).
    """
    strategy = choice.strategy
    if isinstance(inputs, tf.data.Dataset):
        batches = iter(inputs)
        worker_step = tf.function(lambda features, labels: train_step(_OneBatch((features, labels))))

        def step_args() -> tuple:
            return next(batches)
    else:
        @tf.function
        def per_worker_dataset_fn():
            return strategy.distribute_datasets_from_function(inputs)

        per_worker_iterator = iter(coordinator.create_per_worker_dataset(per_worker_dataset_fn))
        worker_step = tf.function(train_step)

        def step_args() -> tuple:
            return (per_worker_iterator,)
    agree = StopAgreement(choice, hooks, collective=False)  # the chief alone runs this loop
    while not controller.is_done:
        count = controller.steps_to_next(plan.total_steps)
        results = [coordinator.schedule(worker_step, args=step_args()) for _ in range(count)]
        coordinator.join()
        fetched = [r.fetch() for r in results]
        controller.after_execution(StepOutputs(*(np.array(values, np.float32) for values in zip(*fetched))), agree)


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
