"""What both training loops start from: seeding, the batch scaling, and the model state restored from a checkpoint."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import random
from collections.abc import Iterator

import keras
import tensorflow as tf

from pipeline_lib.checkpoints import selection
from pipeline_lib.checkpoints.records import CheckpointRecord
from pipeline_lib.checkpoints.run_storage import RunStorage
from pipeline_lib.checkpoints.store import CheckpointStore
from pipeline_lib.cluster.info import ClusterInfo
from pipeline_lib.config import PipelineConfig, Strategy, TrainConfig
from pipeline_lib.data.manifest import Manifest
from pipeline_lib.data.statistics import load_statistics
from pipeline_lib.planning.batch import BatchScaling, create_batch_scaling
from pipeline_lib.planning.sharding import ShardPlan
from pipeline_lib.training import models
from pipeline_lib.training import strategy as strategies
from pipeline_lib.training.early_stopping import PatienceState
from pipeline_lib.training.errors import TrainingError

logger = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoints"
TENSORBOARD_DIR = "tensorboard"


@dataclasses.dataclass(frozen=True)
class TrainingState:
    """The variables a run trains and checkpoints, where they are stored, and the step they were restored at."""

    model: keras.Model
    optimizer: keras.optimizers.Optimizer
    step_var: tf.Variable
    checkpoint: tf.train.Checkpoint
    store: CheckpointStore
    run_storage: RunStorage
    start_step: int  # 0 for a fresh run
    patience: PatienceState  # early stopping's state, in the checkpoint
    restored: CheckpointRecord | None = None  # the checkpoint restored, None for a fresh run


def seed_everything(train_config: TrainConfig) -> None:
    """Seed Python, NumPy and TensorFlow from train.seed; with train.deterministic, also make ops deterministic."""
    if train_config.deterministic:
        keras.utils.set_random_seed(train_config.seed)
        tf.config.experimental.enable_op_determinism()
    elif train_config.seed is not None:
        keras.utils.set_random_seed(train_config.seed)


@contextlib.contextmanager
def private_keras_seeds(seed: int) -> Iterator[None]:
    """Within the block, the seeds Keras draws for initializers and dropout layers built without one come from a
    generator of their own seeded by `seed`, not from Python's global `random`: another thread of the process
    (a server, a client's retry jitter) drawing from that meanwhile would otherwise change the initial weights."""
    from keras.src.random import (
        seed_generator,  # Keras 3 draws every default seed there; no public hook
    )

    shared = seed_generator.python_random
    seed_generator.python_random = random.Random(seed)
    try:
        yield
    finally:
        seed_generator.python_random = shared


def op_determinism_enabled() -> bool:
    """Whether TensorFlow's op determinism is on in this process: set by `train.deterministic` (in this run or an
    earlier one in the same process; TensorFlow offers no public way back) or by the caller. It refuses
    nondeterministic ops, the clock among them."""
    from tensorflow.python.framework import (
        config as tf_config,  # no public reader of the flag (TF 2.21)
    )

    return bool(tf_config.is_op_determinism_enabled())


def batch_for_strategy(plan: ShardPlan, choice: strategies.StrategyChoice, config: PipelineConfig) -> BatchScaling:
    """The batch scaling of a run that is not elastic, after checking that the shard plan was made for its strategy.

    A synchronous strategy's step is the plan's per-replica batch on every replica, which must make the plan's global
    batch. Under parameter_server a step runs on one worker: the plan's per-replica batch on that worker's replicas.

    Raises:
        TrainingError: when the plan's global batch is not the synchronous strategy's, or the plan has no step.
    """
    train = config.train
    if choice.kind == Strategy.PARAMETER_SERVER:
        # ParameterServerStrategy's replicas in sync are those of the one worker that runs a step.
        return create_batch_scaling(per_replica_batch=plan.per_replica_batch_size, num_workers=choice.num_workers,
                                    replicas_per_worker=choice.num_replicas, base_learning_rate=train.base_learning_rate,
                                    lr_scaling=train.lr_scaling, parameter_server=True)
    scaling = create_batch_scaling(per_replica_batch=plan.per_replica_batch_size, num_workers=choice.num_workers,
                                   replicas_per_worker=choice.replicas_per_worker,
                                   base_learning_rate=train.base_learning_rate, lr_scaling=train.lr_scaling)
    if plan.global_batch_size != scaling.global_batch:
        raise TrainingError(
            f"the shard plan's global_batch_size ({plan.global_batch_size}) is not per_replica_batch_size "
            f"({plan.per_replica_batch_size}) × the {choice.num_replicas} replica(s) of strategy "
            f"{choice.kind.value}; re-plan the shards for {choice.num_workers} worker(s) × "
            f"{choice.replicas_per_worker} replica(s)"
        )
    if plan.total_steps < 1 or plan.steps_per_epoch < 1:
        raise TrainingError(
            f"the shard plan has total_steps {plan.total_steps}, steps_per_epoch {plan.steps_per_epoch}; the train "
            f"split is smaller than one global batch of {scaling.global_batch}: lower train.per_replica_batch_size"
        )
    if plan.per_replica_batch_size != train.per_replica_batch_size:
        logger.warning("shard plan per_replica_batch_size %d differs from train.per_replica_batch_size %d; "
                       "using the plan's", plan.per_replica_batch_size, train.per_replica_batch_size)
    return scaling


def create_training_state(config: PipelineConfig, manifest: Manifest, plan: ShardPlan, run_dir: str,
                          cluster: ClusterInfo, choice: strategies.StrategyChoice,
                          batch: BatchScaling) -> TrainingState:
    """Build the model, optimizer and step under the strategy, and restore them from the run's newest checkpoint.

    The optimizer trains at the attempt's learning rate (`batch`); an elastic attempt's is kept whatever rate the
    checkpoint was saved with.

    Raises:
        TrainingError: when the restored checkpoint is past the plan's total_steps.
    """
    run_storage = RunStorage(run_dir, cluster, config.storage_options, checkpoint_subdir=CHECKPOINT_DIR,
                             tensorboard_subdir=TENSORBOARD_DIR)
    model, optimizer, step_var, patience, checkpoint = _create_variables(config, manifest, choice, batch.learning_rate)
    best_metric, best_direction = selection.selection_metric(config)
    store = CheckpointStore(run_storage.local_checkpoint_dir, checkpoint, cluster=cluster,
                            keep=config.train.keep_checkpoints, best_metric=best_metric, best_direction=best_direction)
    restored = _restore(store, checkpoint, model, choice, config, run_storage)
    start_step = int(checkpoint.step.numpy()) if restored is not None else 0
    if config.train.elastic is not None and restored is not None and not config.train.warmup_steps:
        # A constant rate is an optimizer variable, which the restore just set to the rate of the attempt that saved.
        with choice.strategy.scope():
            optimizer.learning_rate = batch.learning_rate
    if start_step > plan.total_steps:
        raise TrainingError(f"the checkpoint in {run_storage.local_checkpoint_dir} is at step {start_step}, past the "
                            f"plan's total_steps ({plan.total_steps}); use a fresh run_dir or raise train.steps")
    if restored is not None and start_step == plan.total_steps:
        logger.info("resuming at step %d of %d: the final step, nothing left to train; the result comes from "
                    "checkpoint %s", start_step, plan.total_steps, restored.path)
    elif start_step:
        logger.info("resuming at step %d of %d", start_step, plan.total_steps)
    return TrainingState(model=model, optimizer=optimizer, step_var=step_var, checkpoint=checkpoint, store=store,
                         run_storage=run_storage, start_step=start_step, patience=patience, restored=restored)


def _create_optimizer(config: PipelineConfig, learning_rate, mixed_precision: bool) -> keras.optimizers.Optimizer:
    if config.train.optimizer == "sgd":
        optimizer = keras.optimizers.SGD(learning_rate=learning_rate)
    else:
        optimizer = keras.optimizers.Adam(learning_rate=learning_rate)
    if mixed_precision:
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    return optimizer


def _build_model(config: PipelineConfig, manifest: Manifest) -> keras.Model:
    statistics = load_statistics(manifest, config.storage_options)
    if not config.train.mixed_precision:
        return models.create_model(config.model, manifest.feature_schema, statistics)
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_float16")
    try:
        return models.create_model(config.model, manifest.feature_schema, statistics)
    finally:
        keras.config.set_dtype_policy(previous)


def _create_variables(config: PipelineConfig, manifest: Manifest, choice: strategies.StrategyChoice,
                      learning_rate: float):
    patience = PatienceState()  # outside the scope: the chief's plain variables, never mirrored nor all-reduced
    with choice.strategy.scope(), private_keras_seeds(config.train.seed):
        model = _build_model(config, manifest)
        rate = strategies.create_learning_rate(learning_rate, config.train.warmup_steps)
        optimizer = _create_optimizer(config, rate, config.train.mixed_precision)
        # Built now, not on the first apply, so a restore finds every slot variable to fill.
        optimizer.build(model.trainable_variables)
        step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step",
                           aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
        # Keras does not checkpoint the dropout seed-generator states with the model; an exact resume
        # needs them, so they ride along under their own key (model-only restores ignore it).
        rng_states = [v.value for v in model.variables if v.path.endswith("seed_generator_state")]
        checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer, step=step, rng=rng_states,
                                         early_stopping=patience)
    return model, optimizer, step, patience, checkpoint


def _restore(store: CheckpointStore, checkpoint: tf.train.Checkpoint, model: keras.Model,
             choice: strategies.StrategyChoice, config: PipelineConfig, run_storage: RunStorage
             ) -> CheckpointRecord | None:
    # A remote run resumes from what the chief published, the same on every worker.
    run_storage.prepare_restore()
    # Checkpoint restoring should be inside scope (b/139450638).
    with choice.strategy.scope():
        record = store.restore_latest()
        if record is not None:
            return record
        if config.train.warm_start_uri:
            tf.train.Checkpoint(model=model).read(config.train.warm_start_uri).assert_existing_objects_matched()
            logger.info("warm start: model weights from %s", config.train.warm_start_uri)
    return None
