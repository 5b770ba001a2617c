"""Tests for pipeline_lib.planning.batch: the global batch, each replica's batch and the scaled learning rate of an
attempt, synchronous, parameter-server or elastic, from one rule."""

from __future__ import annotations

import math

import pytest

from pipeline_lib.config import LrScaling
from pipeline_lib.planning import batch


@pytest.mark.parametrize("rule,replicas,expected", [
    (LrScaling.LINEAR, 4, 0.004), (LrScaling.SQRT, 4, 0.002), (LrScaling.NONE, 4, 0.001),
    ("linear", 1, 0.001), ("sqrt", 2, 0.001 * math.sqrt(2)),
])
def test_scaled_learning_rate(rule, replicas, expected):
    assert batch.scaled_learning_rate(0.001, rule, replicas) == pytest.approx(expected)


def test_scaled_learning_rate_rejects_zero_replicas():
    with pytest.raises(ValueError, match=r"num_replicas \(0\)"):
        batch.scaled_learning_rate(0.1, "linear", 0)


@pytest.mark.parametrize(("configured", "replicas", "expected"), [
    (96, 2, 96),  # splits: kept
    (75, 2, 74),  # 37.5 per replica: 74 and 76 are as near, the smaller wins
    (75, 4, 76),  # 72 is 3 away, 76 is 1
    (21, 2, 20),  # a tie again
    (5, 8, 8),  # never below one record per replica
])
def test_nearest_global_batch(configured, replicas, expected):
    assert batch.nearest_global_batch(configured, replicas) == expected


def _scaling(**values):
    return batch.create_batch_scaling(**{"per_replica_batch": 8, "num_workers": 3, "replicas_per_worker": 2,
                                         "base_learning_rate": 0.01, "lr_scaling": "linear", **values})


def test_a_synchronous_attempt_scales_the_rate_by_its_replicas():
    scaling = _scaling()
    assert (scaling.global_batch, scaling.per_replica_batch, scaling.per_worker_batch) == (48, 8, 16)
    assert scaling.global_batch == batch.global_batch_size(8, 2, 3) == scaling.configured_global_batch
    assert (scaling.learning_rate_replicas, scaling.learning_rate) == (6, pytest.approx(0.06))
    assert _scaling(lr_scaling="sqrt").learning_rate == pytest.approx(0.01 * math.sqrt(6))


def test_a_parameter_server_step_is_one_workers_batch_on_any_worker_count():
    for workers in (3, 1):
        scaling = _scaling(num_workers=workers, parameter_server=True, resize_from=48)
        assert (scaling.global_batch, scaling.configured_global_batch, scaling.per_replica_batch) == (16, 16, 8)
        assert scaling.learning_rate == pytest.approx(0.02)


def test_a_resized_attempt_keeps_the_configured_global_batch_or_takes_the_nearest():
    kept = _scaling(resize_from=48)
    assert kept == _scaling()  # on the planned workers: the run as configured
    shrunk = _scaling(num_workers=2, resize_from=48)  # 48 splits over 2 × 2 replicas: kept
    assert (shrunk.global_batch, shrunk.per_replica_batch, shrunk.learning_rate) == (48, 12, pytest.approx(0.06))
    odd = _scaling(num_workers=5, replicas_per_worker=1, per_replica_batch=7, resize_from=21)
    assert (odd.global_batch, odd.configured_global_batch, odd.per_replica_batch) == (20, 21, 4)
    assert odd.learning_rate == pytest.approx(0.01 * 20 / 7)
