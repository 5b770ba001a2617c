"""One attempt's batch and learning rate: the global batch, each replica's batch and the scaled learning rate.

The rules are written here once. Planning sizes a plan's batches with `global_batch_size`; training builds one
`BatchScaling` per attempt (`create_batch_scaling`), elastic or not, and everything downstream reads it: the step
and the input pipelines (its batches), the optimizer (its learning rate), an elastic run's data position, and the
TrainResult (`global_batch_size`, `scaled_learning_rate`).
"""

from __future__ import annotations

import dataclasses
import math

from pipeline_lib.config import LrScaling


def global_batch_size(per_replica_batch: int, replicas_per_worker: int, num_workers: int) -> int:
    """One synchronous step's batch over every replica of every worker."""
    return per_replica_batch * replicas_per_worker * num_workers


def nearest_global_batch(configured: int, num_replicas: int) -> int:
    """The multiple of `num_replicas` nearest `configured` (at least `num_replicas`); a tie goes to the smaller, so no
    replica holds more than the configured batch needs."""
    below = max(num_replicas, configured // num_replicas * num_replicas)
    above = -(-configured // num_replicas) * num_replicas
    return below if configured - below <= above - configured else above


def scaled_learning_rate(base_lr: float, rule: LrScaling | str, num_replicas: float) -> float:
    """The learning rate for `num_replicas` replicas: base × n (linear), × √n (sqrt) or unchanged (none).

    An elastic run passes a global batch's worth of configured per-replica batches, which may be fractional.
    """
    rule = LrScaling(rule)
    if num_replicas <= 0:
        raise ValueError(f"num_replicas ({num_replicas}) must be > 0")
    if rule == LrScaling.LINEAR:
        return base_lr * num_replicas
    if rule == LrScaling.SQRT:
        return base_lr * math.sqrt(num_replicas)
    return base_lr


@dataclasses.dataclass(frozen=True)
class BatchScaling:
    """One attempt's batch sizes and the learning rate they scale the base rate to.

    `global_batch` is one step's examples: over every replica of every worker under a synchronous strategy, over
    the replicas of the one worker that runs the step under parameter_server. `configured_global_batch` is the
    plan's (train.workers') global batch, which an elastic attempt on fewer workers may not split into; the
    attempt then trains at the nearest global batch that does.
    """

    num_workers: int
    replicas_per_worker: int
    configured_global_batch: int
    global_batch: int
    per_replica_batch: int
    learning_rate: float
    # The global batch in configured per-replica batches: the replicas `train.lr_scaling` scales the base rate by
    # (exactly the plan's replicas when the global batch is kept, so the rate is the full-size run's).
    learning_rate_replicas: float

    @property
    def per_worker_batch(self) -> int:
        return self.global_batch // self.num_workers


def create_batch_scaling(*, per_replica_batch: int, num_workers: int, replicas_per_worker: int,
                         base_learning_rate: float, lr_scaling: LrScaling | str, parameter_server: bool = False,
                         resize_from: int | None = None) -> BatchScaling:
    """The batches and learning rate of an attempt on `num_workers` workers with `replicas_per_worker` each.

    Args:
        per_replica_batch: the plan's per-replica batch (train.per_replica_batch_size as planned).
        num_workers: the attempt's training workers.
        replicas_per_worker: replicas on each of them.
        base_learning_rate: train.base_learning_rate.
        lr_scaling: train.lr_scaling, applied to the global batch in configured per-replica batches.
        parameter_server: a step is one worker's batch (per-replica batch × its replicas), whichever worker runs
            it and on any number of workers.
        resize_from: an elastic attempt's configured global batch (the plan's): kept when it splits over the
            attempt's replicas, otherwise the nearest global batch that does (`nearest_global_batch`). None: the
            per-replica batch over every replica.
    """
    if parameter_server:
        global_batch = per_replica_batch * replicas_per_worker
        configured, per_replica = global_batch, per_replica_batch
    else:
        num_replicas = num_workers * replicas_per_worker
        if resize_from is None:
            global_batch = configured = global_batch_size(per_replica_batch, replicas_per_worker, num_workers)
        else:
            global_batch, configured = nearest_global_batch(resize_from, num_replicas), resize_from
        per_replica = global_batch // num_replicas
    lr_replicas = global_batch / per_replica_batch
    return BatchScaling(num_workers=num_workers, replicas_per_worker=replicas_per_worker,
                        configured_global_batch=configured, global_batch=global_batch, per_replica_batch=per_replica,
                        learning_rate=scaled_learning_rate(base_learning_rate, lr_scaling, lr_replicas),
                        learning_rate_replicas=lr_replicas)
