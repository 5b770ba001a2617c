"""Tests for pipeline_lib.training.strategy: auto selection, strategies on logical CPUs, the learning-rate warmup."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from pipeline_lib.cluster.info import ClusterInfo
from pipeline_lib.config import Collective, Strategy, TrainConfig
from pipeline_lib.training import strategy as strategies

TWO_WORKERS = ClusterInfo(task_type="worker", task_index=0, cluster={"worker": ("127.0.0.1:1", "127.0.0.1:2")})
WITH_PS = ClusterInfo(task_type="chief", task_index=0,
                      cluster={"chief": ("127.0.0.1:1",), "worker": ("127.0.0.1:2",), "ps": ("127.0.0.1:3",)})


@pytest.mark.parametrize("warmup_steps,expected", [(4, [0.1, 0.2, 0.3, 0.4, 0.4, 0.4, 0.4]), (0, [0.4] * 7)])
def test_warmup_is_linear_then_constant_in_the_traced_step_and_where_progress_reads_it(warmup_steps, expected):
    schedule = strategies.WarmupSchedule(0.4, warmup_steps=warmup_steps)
    traced = tf.function(schedule)
    in_graph = [float(traced(tf.constant(step, tf.int64))) for step in range(7)]
    eager = [float(schedule(tf.Variable(step, dtype=tf.int64))) for step in range(7)]  # as optimizer.iterations
    np.testing.assert_allclose(in_graph, expected, rtol=1e-6)
    assert eager == in_graph  # the same float32 arithmetic, bit for bit
    assert strategies.WarmupSchedule.from_config(schedule.get_config()).warmup_steps == warmup_steps


def test_create_learning_rate_warms_up_the_scaled_rate():
    rate = strategies.create_learning_rate(0.02, warmup_steps=10)
    assert isinstance(rate, strategies.WarmupSchedule) and rate.learning_rate == pytest.approx(0.02)
    assert strategies.create_learning_rate(0.02, 0) == 0.02


@pytest.mark.parametrize("train,cluster,gpus,kind", [
    (TrainConfig(), ClusterInfo(), 0, Strategy.DEFAULT),
    (TrainConfig(), ClusterInfo(), 1, Strategy.ONE_DEVICE),
    (TrainConfig(), ClusterInfo(), 4, Strategy.MIRRORED),
    (TrainConfig(cpu_replicas=2), ClusterInfo(), 0, Strategy.MIRRORED),
    (TrainConfig(), TWO_WORKERS, 4, Strategy.MULTI_WORKER_MIRRORED),
    (TrainConfig(), WITH_PS, 0, Strategy.PARAMETER_SERVER),
    (TrainConfig(strategy="one_device"), TWO_WORKERS, 0, Strategy.ONE_DEVICE),
])
def test_auto_selection(train, cluster, gpus, kind):
    chosen, reason = strategies.choose_kind(train, cluster, num_gpus=gpus)
    assert chosen == kind
    assert reason


def test_default_strategy():
    choice = strategies.create_strategy(TrainConfig(strategy="default"), ClusterInfo())
    assert choice.kind == Strategy.DEFAULT and choice.num_replicas == 1 and choice.num_workers == 1


def test_mirrored_on_two_logical_cpus():
    train = TrainConfig(strategy="mirrored", cpu_replicas=2)
    strategies.configure_devices(train)  # already split by conftest: accepted
    choice = strategies.create_strategy(train, ClusterInfo())
    assert isinstance(choice.strategy, tf.distribute.MirroredStrategy)
    assert choice.num_replicas == 2 and choice.replicas_per_worker == 2
    assert "CPU:1" in choice.reason


def test_auto_with_cpu_replicas_is_mirrored():
    choice = strategies.create_strategy(TrainConfig(cpu_replicas=2), ClusterInfo())
    assert choice.kind == Strategy.MIRRORED and choice.num_replicas == 2
    assert "cpu_replicas" in choice.reason


def test_one_device():
    choice = strategies.create_strategy(TrainConfig(strategy="one_device"), ClusterInfo())
    assert isinstance(choice.strategy, tf.distribute.OneDeviceStrategy) and choice.num_replicas == 1


def test_configure_devices_after_initialisation_names_the_fix():
    with pytest.raises(strategies.StrategyError, match=r"cpu_replicas \(4\) .* already initialised with 2"):
        strategies.configure_devices(TrainConfig(cpu_replicas=4))


def test_communication_options_follow_the_config():
    options = strategies._communication(TrainConfig(communication=Collective.RING, gradient_pack_mb=2.0))
    assert options.implementation == tf.distribute.experimental.CommunicationImplementation.RING
    assert options.bytes_per_pack == 2 * 1024 * 1024


def test_parameter_server_without_ps_names_the_fix():
    with pytest.raises(strategies.StrategyError, match="parameter_servers"):
        strategies.create_strategy(TrainConfig(strategy="parameter_server"), ClusterInfo())


def test_tpu_cannot_run_without_a_tpu():
    """There is no TPU on this machine: asking for one fails with a clear error instead of hanging."""
    with pytest.raises(strategies.StrategyError, match="no TPU is reachable"):
        strategies.create_strategy(TrainConfig(strategy="tpu"), ClusterInfo())
