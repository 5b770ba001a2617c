"""The loop's training input: each epoch's batches for one input pipeline, reshuffled by a fixed seed per epoch;
for an elastic run, each worker's slice of one global order."""

from __future__ import annotations

from collections.abc import Callable

import tensorflow as tf

from pipeline_lib.config import TrainConfig
from pipeline_lib.data.manifest import Manifest
from pipeline_lib.planning.sharding import AutoShardPolicy, ShardPlan
from pipeline_lib.training import input_pipeline
from pipeline_lib.training.elastic import ElasticAttempt
from pipeline_lib.training.errors import TrainingError

DatasetFn = Callable[[tf.distribute.InputContext], tf.data.Dataset]
# A watcher of one input pipeline's batches (`TrainHooks.input_batches`): (batches, pipeline id, start step) → batches.
InputBatchesFn = Callable[[tf.data.Dataset, int, int], tf.data.Dataset]


def epoch_seed(seed: int, epoch: int | tf.Tensor) -> int | tf.Tensor:
    """The shuffle seed of an epoch: a fixed function of (seed, epoch), so a resumed run reshuffles alike.

    `epoch` is an int or, inside the training input pipeline, an int64 tensor: the same value either way. The
    seed's part is reduced in Python first, so a seed of any size never overflows the tensor's int64.
    """
    modulus = 2**31 - 1
    return ((seed * 1_000_003 + 1) % modulus + epoch * 7_919) % modulus


def epochs_dataset(manifest: Manifest, train_config: TrainConfig, batch: int, files: tuple[str, ...] | None,
                   shard: tuple[int, int] | None, is_classification: bool, batches_per_epoch: int,
                   start_epoch: int, first_skip: int, num_epochs: int) -> tf.data.Dataset:
    """One input pipeline's batches for epochs start_epoch..num_epochs-1 in one dataset, built and traced once.

    Epoch e is `create_dataset` shuffled with `epoch_seed(seed, e)` and cut to `batches_per_epoch`, so a resumed
    run sees the batches an uninterrupted one saw; the first epoch skips the `first_skip` already trained.
    Rebuilding the pipeline for each epoch instead costs Python and tracing per epoch, more than a small epoch's
    whole input.
    """

    # Built once by plain Python: AutoGraph (flat_map's default) would convert this and every builder it calls,
    # a large share of a fresh process's first training, for no control flow on tensors (the skip is a tf.where).
    # The functions the builders pass to `map` are still converted, by their own trace.
    @tf.autograph.experimental.do_not_convert
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


def _pipeline_data(plan: ShardPlan, pipeline_id: int, num_pipelines: int) -> tuple[tuple[str, ...] | None,
                                                                                    tuple[int, int] | None]:
    """The files and record shard one input pipeline reads under the plan's policy."""
    if plan.policy == AutoShardPolicy.FILE:
        return plan.files_for(pipeline_id), None
    # DATA: every pipeline reads every file and keeps every num_pipelines-th record, so that global batch k
    # is records [k·B, (k+1)·B) whatever the split of B into workers and replicas.
    return None, (num_pipelines, pipeline_id) if num_pipelines > 1 else None


def create_synchronous_dataset_fn(manifest: Manifest, plan: ShardPlan, train_config: TrainConfig, num_replicas: int,
                                  global_batch: int, start_step: int, is_classification: bool,
                                  input_batches: InputBatchesFn | None = None) -> DatasetFn:
    """The `dataset_fn` of a synchronous strategy: the plan's share of every epoch, resumed at `start_step`.

    Raises (when called):
        TrainingError: when an input pipeline's files hold fewer batches than the plan's steps need.
    """
    steps_per_epoch = plan.steps_per_epoch
    num_epochs = -(-plan.total_steps // steps_per_epoch)
    start_epoch, start_position = divmod(start_step, steps_per_epoch)

    def dataset_fn(input_context: tf.distribute.InputContext) -> tf.data.Dataset:
        batch = input_context.get_per_replica_batch_size(global_batch)
        num_pipelines, pipeline_id = input_context.num_input_pipelines, input_context.input_pipeline_id
        replicas_per_pipeline = max(1, num_replicas // num_pipelines)
        files, shard = _pipeline_data(plan, pipeline_id, num_pipelines)
        needed = steps_per_epoch * replicas_per_pipeline
        available = input_pipeline.num_shard_records(manifest, "train", files, shard) // batch
        if available < needed:
            raise TrainingError(
                f"input pipeline {pipeline_id} of {num_pipelines} holds {available} batches of {batch} per epoch "
                f"but the shard plan needs {needed} ({steps_per_epoch} steps × {replicas_per_pipeline} replicas); "
                "re-plan the shards for this cluster"
            )
        batches = epochs_dataset(manifest, train_config, batch, files, shard, is_classification, needed,
                                 start_epoch, start_position * replicas_per_pipeline, num_epochs)
        return input_batches(batches, pipeline_id, start_step) if input_batches is not None else batches

    return dataset_fn


def create_parameter_server_dataset_fn(manifest: Manifest, train_config: TrainConfig, global_batch: int,
                                       is_classification: bool) -> DatasetFn:
    """The `dataset_fn` of parameter_server: workers train asynchronously on their own passes over the whole split.

    With `train.shuffle`, worker i shuffles with `epoch_seed(train.seed, i)` (each pass reshuffled from it), so
    every worker's order is fixed by the seed; which worker runs which step, and so the updates' order, is not
    (see the README: parameter-server runs are not reproducible).
    """

    def dataset_fn(input_context: tf.distribute.InputContext) -> tf.data.Dataset:
        batch = input_context.get_per_replica_batch_size(global_batch)
        return input_pipeline.create_dataset(
            manifest, "train", batch, shuffle=train_config.shuffle,
            seed=epoch_seed(train_config.seed, input_context.input_pipeline_id),
            shuffle_buffer=train_config.shuffle_buffer, repeat=True, drop_remainder=True,
            is_classification=is_classification)

    return dataset_fn


def elastic_records(manifest: Manifest, train_config: TrainConfig, *, epoch_records: int, start_record: int,
                    global_batch: int, num_workers: int, worker: int, num_steps: int,
                    with_ids: bool = False) -> tf.data.Dataset:
    """One worker's records of an elastic run for `num_steps` global steps from record `start_record` of its stream.

    Epoch e's order is every train record in file order, shuffled with `epoch_seed(train.seed, e)` (the same on
    every worker, whatever their number), cut to its first `epoch_records`; the stream is the epochs' orders one
    after the other. Global step j takes records [start_record + j·G, start_record + (j+1)·G) of it, G =
    `global_batch`, and worker w of K its slice [w·G/K, (w+1)·G/K) of those: so each record of each epoch is used
    once, however the steps were split over attempts of different sizes. `with_ids` yields each record's index in
    file order instead of the record (the same order: a shuffle's permutation does not depend on the values).
    """
    return elastic_record_chunks(manifest, train_config, epoch_records=epoch_records, start_record=start_record,
                                 global_batch=global_batch, num_workers=num_workers, worker=worker,
                                 num_steps=num_steps, steps_per_chunk=1, with_ids=with_ids).unbatch()


def elastic_record_chunks(manifest: Manifest, train_config: TrainConfig, *, epoch_records: int, start_record: int,
                          global_batch: int, num_workers: int, worker: int, num_steps: int, steps_per_chunk: int,
                          with_ids: bool = False) -> tf.data.Dataset:
    """`elastic_records` in chunks: each element is the worker's records of `steps_per_chunk` consecutive global
    steps (the last chunk fewer), as one 1-D tensor, ready to be parsed in one call.

    The stream is cut into G·steps_per_chunk records at a time and each cut viewed as steps_per_chunk rows of G, of
    which the worker keeps its columns: no record is unbatched and re-batched, which made the elastic input cost
    twice the CPU per batch of a plain one (every worker still reads and shuffles every record: the global order
    is a shuffle of them all, and a TFRecord file has no random access).
    """
    if global_batch % num_workers:
        raise TrainingError(f"global batch {global_batch} does not split over {num_workers} workers; "
                            "elastic.create_attempt chooses one that does")
    per_worker = global_batch // num_workers
    first_epoch, offset = divmod(start_record, epoch_records)
    num_epochs = first_epoch + -(-(offset + num_steps * global_batch) // epoch_records)
    low, high = worker * per_worker, (worker + 1) * per_worker

    def epoch_order(epoch: tf.Tensor) -> tf.data.Dataset:
        _seedable_in_trace()
        records = input_pipeline.read_records(manifest, "train")
        if with_ids:
            records = records.enumerate().map(lambda index, _record: index)
        if train_config.shuffle:
            records = records.shuffle(train_config.shuffle_buffer, seed=epoch_seed(train_config.seed, epoch),
                                      reshuffle_each_iteration=True)
        return records.take(epoch_records)

    stream = tf.data.Dataset.range(first_epoch, num_epochs).flat_map(epoch_order).skip(offset)
    chunks = stream.take(num_steps * global_batch).batch(global_batch * steps_per_chunk)
    return chunks.map(lambda chunk: tf.reshape(tf.reshape(chunk, [-1, global_batch])[:, low:high], [-1]))


def create_elastic_dataset_fn(manifest: Manifest, train_config: TrainConfig, attempt: ElasticAttempt, total_steps: int,
                              is_classification: bool, input_batches: InputBatchesFn | None = None) -> DatasetFn:
    """The `dataset_fn` of an elastic run's attempt: each worker's slice of the global order (`elastic_records`)
    from the attempt's position to `total_steps`, in per-replica batches.

    Raises (when called):
        TrainingError: when the strategy's input pipelines are not the attempt's workers.
    """

    def dataset_fn(input_context: tf.distribute.InputContext) -> tf.data.Dataset:
        if input_context.num_input_pipelines != attempt.num_workers:
            raise TrainingError(f"the strategy has {input_context.num_input_pipelines} input pipeline(s) but the "
                                f"elastic attempt {attempt.num_workers} worker(s); one input pipeline per worker")
        batch = input_context.get_per_replica_batch_size(attempt.global_batch)
        # Parse about PARSE_BATCH_ROWS records per call, as a plain pipeline does: whole steps of this worker's slice.
        steps_per_chunk = max(1, input_pipeline.parse_batch_size(batch) // attempt.per_worker_batch)
        chunks = elastic_record_chunks(manifest, train_config, epoch_records=attempt.epoch_records,
                                       start_record=attempt.start_records, global_batch=attempt.global_batch,
                                       num_workers=attempt.num_workers, worker=input_context.input_pipeline_id,
                                       num_steps=total_steps - attempt.start_step, steps_per_chunk=steps_per_chunk)
        batches = input_pipeline.batches_from_record_chunks(chunks, manifest, batch, drop_remainder=True,
                                                            is_classification=is_classification,
                                                            rebatch=steps_per_chunk * attempt.per_worker_batch != batch)
        if input_batches is not None:
            batches = input_batches(batches, input_context.input_pipeline_id, attempt.start_step)
        return batches

    return dataset_fn


def create_elastic_coordinator_batches(manifest: Manifest, train_config: TrainConfig, attempt: ElasticAttempt,
                                       total_steps: int, is_classification: bool,
                                       input_batches: InputBatchesFn | None = None) -> tf.data.Dataset:
    """The batches of an elastic parameter-server attempt, read by the coordinator: batch j is global step j's.

    Under parameter_server the coordinator schedules each step on whichever worker is free, so per-worker datasets
    would let the order of the steps decide which examples are trained. The coordinator reads the global order
    (`elastic_records`, one reader) and ships each step's batch with the step instead: each example of each epoch
    is trained once, and the checkpoint's position is exact, however many workers run the steps and whichever
    runs which. The cost is that every batch passes through the coordinator (see the README).
    """
    batch = attempt.global_batch
    steps_per_chunk = input_pipeline.parse_batch_size(batch) // batch
    chunks = elastic_record_chunks(manifest, train_config, epoch_records=attempt.epoch_records,
                                   start_record=attempt.start_records, global_batch=batch, num_workers=1, worker=0,
                                   num_steps=total_steps - attempt.start_step, steps_per_chunk=steps_per_chunk)
    batches = input_pipeline.batches_from_record_chunks(chunks, manifest, batch, drop_remainder=True,
                                                        is_classification=is_classification)
    return input_batches(batches, 0, attempt.start_step) if input_batches is not None else batches
