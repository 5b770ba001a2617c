"""tf.distribute strategy selection, logical CPU devices, and the learning-rate warmup."""

from __future__ import annotations

import dataclasses
import logging

import keras
import numpy as np
import tensorflow as tf

from pipeline_lib.cluster.info import ClusterInfo
from pipeline_lib.config import (
    Collective,
    Strategy,
    TrainConfig,
    strategy_for_cluster,
)
from pipeline_lib.core.errors import UserError

logger = logging.getLogger(__name__)


class StrategyError(UserError, RuntimeError):
    """The requested strategy cannot be built here; the message names the setting and the fix."""


@dataclasses.dataclass(frozen=True)
class StrategyChoice:
    """The strategy object with what it is and why it was chosen."""

    strategy: tf.distribute.Strategy
    kind: Strategy
    reason: str
    num_replicas: int  # num_replicas_in_sync, over every worker
    num_workers: int

    @property
    def replicas_per_worker(self) -> int:
        return max(1, self.num_replicas // max(1, self.num_workers))


def configure_devices(train: TrainConfig) -> None:
    """Split the CPU into `train.cpu_replicas` logical devices; call at process start.

    Raises:
        StrategyError: when TensorFlow has already initialised with fewer logical CPUs than asked.
    """
    wanted = train.cpu_replicas
    if not wanted or wanted < 2:
        return
    cpus = tf.config.list_physical_devices("CPU")
    current = tf.config.get_logical_device_configuration(cpus[0])
    if current is not None and len(current) == wanted:
        return
    try:
        tf.config.set_logical_device_configuration(
            cpus[0], [tf.config.LogicalDeviceConfiguration() for _ in range(wanted)]
        )
    except RuntimeError as error:
        have = len(tf.config.list_logical_devices("CPU"))
        if have >= wanted:
            logger.info("TensorFlow already initialised with %d logical CPUs; using them", have)
            return
        raise StrategyError(
            f"train.cpu_replicas ({wanted}) needs {wanted} logical CPU devices but TensorFlow is already "
            f"initialised with {have} in this process; with train.isolation: none the training shares the task's "
            f"process, so set train.isolation: process (or call configure_devices() before any TensorFlow op)"
        ) from error
    logger.info("split the CPU into %d logical devices", wanted)


def _local_cpus(train: TrainConfig) -> list[str]:
    devices = [d.name for d in tf.config.list_logical_devices("CPU")]
    return devices[: train.cpu_replicas] if train.cpu_replicas else devices[:1]


def _communication(train: TrainConfig) -> tf.distribute.experimental.CommunicationOptions:
    implementation = {
        Collective.AUTO: tf.distribute.experimental.CommunicationImplementation.AUTO,
        Collective.RING: tf.distribute.experimental.CommunicationImplementation.RING,
        Collective.NCCL: tf.distribute.experimental.CommunicationImplementation.NCCL,
    }[train.communication]
    return tf.distribute.experimental.CommunicationOptions(
        bytes_per_pack=int(train.gradient_pack_mb * 1024 * 1024), implementation=implementation
    )


def choose_kind(train: TrainConfig, cluster: ClusterInfo, num_gpus: int | None = None) -> tuple[Strategy, str]:
    """Resolve `auto` into a concrete strategy kind, with the reason in words."""
    if num_gpus is None:
        num_gpus = len(tf.config.list_physical_devices("GPU"))
    if train.strategy != Strategy.AUTO:
        return train.strategy, f"train.strategy is {train.strategy.value!r}"
    kind = strategy_for_cluster(train.strategy, has_ps=cluster.has_ps, num_workers=cluster.num_workers)
    if kind == Strategy.PARAMETER_SERVER:
        return kind, f"auto: TF_CONFIG lists {len(cluster.cluster['ps'])} parameter server(s)"
    if kind == Strategy.MULTI_WORKER_MIRRORED:
        return kind, f"auto: TF_CONFIG lists {cluster.num_workers} workers"
    if num_gpus > 1:
        return Strategy.MIRRORED, f"auto: {num_gpus} local GPUs"
    if num_gpus == 1:
        return Strategy.ONE_DEVICE, "auto: one local GPU"
    if train.cpu_replicas and train.cpu_replicas > 1:
        return Strategy.MIRRORED, f"auto: train.cpu_replicas is {train.cpu_replicas} (no GPU)"
    return Strategy.DEFAULT, "auto: one worker, no GPU"


def _resolver(cluster: ClusterInfo) -> tf.distribute.cluster_resolver.SimpleClusterResolver:
    spec = tf.train.ClusterSpec({job: list(addresses) for job, addresses in cluster.cluster.items()})
    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        spec, task_type=cluster.task_type, task_id=cluster.task_index, rpc_layer="grpc"
    )


def create_strategy(train: TrainConfig, cluster: ClusterInfo) -> StrategyChoice:
    """Build the tf.distribute strategy `train.strategy` asks for (resolving `auto`).

    Args:
        train: the `train` config section.
        cluster: this process's cluster value (ClusterInfo() when single-process).

    Returns:
        The StrategyChoice; its reason is also logged.

    Raises:
        StrategyError: when the strategy cannot be built here (no TPU, no cluster for a multi-worker kind...).
    """
    kind, reason = choose_kind(train, cluster)
    num_workers = 1
    # Listing logical devices initialises TensorFlow, which multi-worker strategies must precede.
    local_gpus = (lambda: [d.name for d in tf.config.list_logical_devices("GPU")])
    if kind == Strategy.DEFAULT:
        strategy = tf.distribute.get_strategy()
    elif kind == Strategy.ONE_DEVICE:
        gpus = local_gpus()
        device = gpus[0] if gpus else _local_cpus(train)[0]
        strategy = tf.distribute.OneDeviceStrategy(device)
        reason += f"; device {device}"
    elif kind == Strategy.MIRRORED:
        if train.cpu_replicas:
            devices = _local_cpus(train)
            if len(devices) < train.cpu_replicas:
                raise StrategyError(
                    f"train.cpu_replicas ({train.cpu_replicas}) but only {len(devices)} logical CPU device(s) "
                    "exist; call strategy.configure_devices(train) at process start"
                )
        else:
            devices = local_gpus() or _local_cpus(train)
        strategy = tf.distribute.MirroredStrategy(devices)
        reason += f"; devices {devices}"
    elif kind == Strategy.MULTI_WORKER_MIRRORED:
        if not cluster.cluster:
            logger.warning("multi_worker_mirrored without TF_CONFIG: training as a single worker")
            resolver = None
        else:
            resolver = _resolver(cluster)
        strategy = tf.distribute.MultiWorkerMirroredStrategy(
            cluster_resolver=resolver, communication_options=_communication(train)
        )
        num_workers = cluster.num_workers
        reason += f"; collective {train.communication.value}, pack {train.gradient_pack_mb} MB"
    elif kind == Strategy.PARAMETER_SERVER:
        if not cluster.has_ps:
            raise StrategyError(
                "train.strategy 'parameter_server' needs a TF_CONFIG cluster with 'ps' tasks; set "
                "train.parameter_servers ≥ 1 so the launcher starts them, or choose another strategy"
            )
        strategy = tf.distribute.experimental.ParameterServerStrategy(_resolver(cluster))
        num_workers = len(cluster.cluster.get("worker", ()))
    elif kind == Strategy.TPU:
        strategy = _create_tpu_strategy()
    else:  # pragma: no cover - every enum member is handled above
        raise StrategyError(f"unknown strategy {kind!r}")
    num_replicas = strategy.num_replicas_in_sync
    logger.info("strategy %s with %d replica(s) over %d worker(s): %s", kind.value, num_replicas, num_workers, reason)
    return StrategyChoice(strategy=strategy, kind=kind, reason=reason, num_replicas=num_replicas,
                          num_workers=num_workers)


def _create_tpu_strategy() -> tf.distribute.Strategy:
    try:
        resolver = tf.distribute.cluster_resolver.TPUClusterResolver()
        tf.config.experimental_connect_to_cluster(resolver)
        tf.tpu.experimental.initialize_tpu_system(resolver)
    except (ValueError, RuntimeError, tf.errors.OpError) as error:
        raise StrategyError(
            f"train.strategy 'tpu' but no TPU is reachable from this machine ({error}); run on a TPU VM or "
            "choose another strategy"
        ) from error
    return tf.distribute.TPUStrategy(resolver)


@keras.saving.register_keras_serializable(package="tfdag")
class WarmupSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """Linear warmup from lr/warmup_steps to lr over `warmup_steps`, then constant."""

    def __init__(self, learning_rate: float, warmup_steps: int):
        self.learning_rate = float(learning_rate)
        self.warmup_steps = int(warmup_steps)

    def __call__(self, step):
        if tf.executing_eagerly():  # the rate read for progress after each execution: arithmetic, not five ops
            return self.rate_at(int(step))
        lr = tf.constant(self.learning_rate, tf.float32)
        if self.warmup_steps <= 0:
            return lr
        # optimizer.iterations counts applied updates, so update k+1 uses (k+1)/warmup of the rate.
        progress = tf.cast(step + 1, tf.float32) / float(self.warmup_steps)
        return lr * tf.minimum(1.0, progress)

    def rate_at(self, step: int) -> float:
        """The rate of the update after `step` updates, as the traced schedule computes it (in float32)."""
        if self.warmup_steps <= 0:
            return float(np.float32(self.learning_rate))
        progress = np.float32(step + 1) / np.float32(self.warmup_steps)
        return float(np.float32(self.learning_rate) * min(np.float32(1.0), progress))

    def get_config(self):
        return {"learning_rate": self.learning_rate, "warmup_steps": self.warmup_steps}


def create_learning_rate(learning_rate: float, warmup_steps: int):
    """The optimizer's learning rate: the attempt's scaled rate (`planning.batch.BatchScaling.learning_rate`), behind
    the warmup schedule when `warmup_steps` (train.warmup_steps) > 0."""
    return WarmupSchedule(learning_rate, warmup_steps) if warmup_steps else learning_rate


def replicas_per_worker(train: TrainConfig) -> int:
    """Replicas each training worker will hold, known before any strategy is built (for shard planning).

    Only lists physical devices, which does not initialise the TensorFlow runtime.
    """
    if train.strategy in (Strategy.DEFAULT, Strategy.ONE_DEVICE, Strategy.PARAMETER_SERVER, Strategy.TPU):
        return 1
    if train.cpu_replicas:
        return train.cpu_replicas
    if train.uses_parameter_server():  # auto with parameter servers: one replica per worker
        return 1
    return max(1, len(tf.config.list_physical_devices("GPU")))
