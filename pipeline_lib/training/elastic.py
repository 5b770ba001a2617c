"""Elastic training (`train.elastic`): the sizes of an attempt on however many workers its cluster has, and where
it stands in the data.

Every attempt of an elastic run keeps the shard plan of `train.workers` (its global batch and step counts) and takes
its worker count K from the cluster it is given (TF_CONFIG). The global batch G of the plan is kept when it splits
over the attempt's K × r replicas; otherwise the nearest global batch that does is used, a tie going to the smaller,
and the learning rate follows it by `train.lr_scaling`. The data is one global order per epoch (`epochs.
elastic_records`); the position in it is counted in records and kept in each checkpoint's manifest (`DataPosition`),
so an attempt of any size continues where the last one stopped. Under parameter_server the coordinator reads that
order itself and ships each step's batch with the step (`epochs.create_elastic_coordinator_batches`): step j trains
batch j whichever worker runs it, so the same position holds on any number of workers.
"""

from __future__ import annotations

import dataclasses
import logging

from pipeline_lib.checkpoints.records import CheckpointRecord, DataPosition
from pipeline_lib.config import TrainConfig
from pipeline_lib.planning.batch import BatchScaling, create_batch_scaling
from pipeline_lib.planning.sharding import AutoShardPolicy, ShardPlan
from pipeline_lib.training.errors import TrainingError

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ElasticAttempt(BatchScaling):
    """One attempt of an elastic run: its batch scaling (sizes and learning rate, `planning.batch`) and the record of
    the training stream it starts at.

    The training stream is every epoch's order (all train records, shuffled with the epoch's seed), each cut to
    `epoch_records` = floor(N / G) · G records for the configured global batch G, one after the other; global step j
    of the attempt consumes records [start_records + j · global_batch, start_records + (j + 1) · global_batch).
    """

    epoch_records: int
    start_step: int = 0
    start_records: int = 0

    def position_at(self, step: int) -> DataPosition:
        """The data position after global step `step` of this attempt (for the checkpoint of that step)."""
        return DataPosition(records=self.start_records + (step - self.start_step) * self.global_batch,
                            epoch_records=self.epoch_records, num_workers=self.num_workers,
                            global_batch=self.global_batch, configured_global_batch=self.configured_global_batch,
                            learning_rate=self.learning_rate)

    def describe(self) -> str:
        """One log line: the workers, the global batch and why, the learning rate, where the data resumes."""
        batch = f"global batch {self.global_batch}"
        if self.global_batch != self.configured_global_batch:
            batch += (f" (the configured {self.configured_global_batch} does not split over {self.num_workers} × "
                      f"{self.replicas_per_worker} replica(s); the nearest that does, a tie to the smaller)")
        epoch, offset = divmod(self.start_records, self.epoch_records)
        return (f"elastic attempt on {self.num_workers} worker(s): {batch}, {self.per_replica_batch} per replica, "
                f"learning rate {self.learning_rate:.6g}; from step {self.start_step}, record {offset} of epoch "
                f"{epoch} ({self.epoch_records} records per epoch)")


def create_attempt(plan: ShardPlan, train_config: TrainConfig, num_workers: int, replicas_per_worker: int, *,
                   parameter_server: bool = False) -> ElasticAttempt:
    """The sizes of an attempt on `num_workers` workers (from the cluster) with `replicas_per_worker` each.

    Under parameter_server (`parameter_server`) a step is one worker's batch, whichever worker runs it: the step's
    batch (`global_batch`) is the plan's per-replica batch × the replicas per worker on any number of workers, and
    the learning rate is the one a parameter-server run of `train.workers` has.

    Raises:
        TrainingError: when the plan is not the DATA plan of `train.workers`, or the worker count is outside
            [train.elastic.min_workers, train.workers].
    """
    if plan.num_workers != train_config.workers or plan.policy != AutoShardPolicy.DATA:
        raise TrainingError(
            f"the shard plan is a {plan.policy.value} plan for {plan.num_workers} worker(s), but an elastic run keeps "
            f"the DATA plan of train.workers ({train_config.workers}) on every attempt, whatever its size; pass "
            "sharding.plan_for_train(manifest, train, replicas_per_worker) unchanged (the cluster gives the size)")
    problem = train_config.elastic_workers_problem(num_workers)
    if problem is not None:
        raise TrainingError(f"the cluster (TF_CONFIG) lists {problem}; start the attempt on that many workers")
    if plan.replicas_per_worker != replicas_per_worker:
        raise TrainingError(
            f"the shard plan has {plan.replicas_per_worker} replica(s) per worker but the strategy has "
            f"{replicas_per_worker}; every attempt of an elastic run needs the replicas per worker the plan was made "
            "for (train.cpu_replicas, GPUs per worker)")
    scaling = create_batch_scaling(per_replica_batch=plan.per_replica_batch_size, num_workers=num_workers,
                                   replicas_per_worker=replicas_per_worker,
                                   base_learning_rate=train_config.base_learning_rate,
                                   lr_scaling=train_config.lr_scaling, parameter_server=parameter_server,
                                   resize_from=plan.global_batch_size)
    return ElasticAttempt(**dataclasses.asdict(scaling), epoch_records=plan.steps_per_epoch * plan.global_batch_size)


def resume(attempt: ElasticAttempt, restored: CheckpointRecord | None, start_step: int) -> ElasticAttempt:
    """The attempt starting where the restored checkpoint's data position says (record 0 for a fresh run).

    A checkpoint without a position (saved without train.elastic, or by an older tfdag) resumes at
    start_step × the configured global batch, with a warning: exact only if every earlier step had that batch.

    Raises:
        TrainingError: when the checkpoint's epochs were cut to another length (the data or the plan changed).
    """
    if restored is None or start_step == 0:
        return dataclasses.replace(attempt, start_step=start_step, start_records=0)
    position = restored.data_position
    if position is None:
        records = start_step * attempt.configured_global_batch
        logger.warning("checkpoint %s records no data position (saved without train.elastic, or by an older tfdag): "
                       "the elastic order resumes at step %d × global batch %d = record %d", restored.path,
                       start_step, attempt.configured_global_batch, records)
        return dataclasses.replace(attempt, start_step=start_step, start_records=records)
    if position.epoch_records != attempt.epoch_records:
        raise TrainingError(
            f"checkpoint {restored.path} was saved with epochs of {position.epoch_records} records, but this plan "
            f"cuts them to {attempt.epoch_records} (its steps per epoch × global batch {attempt.configured_global_batch}"
            "); the data or train.per_replica_batch_size changed: use a fresh run_dir, or the run's own config and data")
    return dataclasses.replace(attempt, start_step=start_step, start_records=position.records)
