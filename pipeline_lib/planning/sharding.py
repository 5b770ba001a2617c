"""Shard planning: FILE vs DATA autosharding, files balanced over workers, equal steps per epoch."""

from __future__ import annotations

import enum
import heapq
import logging

from pydantic import BaseModel, ConfigDict

from pipeline_lib.config import AutoShard, TrainConfig
from pipeline_lib.core.errors import UserError
from pipeline_lib.data.manifest import Manifest
from pipeline_lib.planning.batch import global_batch_size

logger = logging.getLogger(__name__)


class AutoShardPolicy(str, enum.Enum):
    FILE = "file"  # each worker reads only its own files
    DATA = "data"  # every worker reads every file and keeps its 1/N slice


class WorkerAssignment(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    worker_index: int
    files: tuple[str, ...]  # shard paths relative to the dataset directory
    num_records: int  # records this worker sees per epoch


class ShardPlan(BaseModel):
    """How the train split is spread over the workers, and how many steps each one runs."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    policy: AutoShardPolicy
    num_workers: int
    replicas_per_worker: int
    per_replica_batch_size: int
    global_batch_size: int
    steps_per_epoch: int  # identical on every worker
    epochs: int
    total_steps: int
    assignments: tuple[WorkerAssignment, ...]
    imbalance_ratio: float  # max / mean records per worker (1.0 is perfect)
    warnings: tuple[str, ...] = ()

    def files_for(self, worker_index: int) -> tuple[str, ...]:
        return self.assignments[worker_index].files

    def to_markdown(self) -> str:
        """The plan as a markdown table (see `plan_to_markdown`)."""
        return plan_to_markdown(self)


class PlanError(UserError, ValueError):
    """The data cannot be planned over the workers as asked; the message names the counts and the fix."""


# FILE autosharding is kept only while the busiest worker holds at most this much more than the mean:
# with equal steps per epoch, every record above the least-loaded worker's share is skipped each epoch.
MAX_FILE_IMBALANCE = 1.25
# Above this, a FILE plan still warns about the records the busiest worker leaves out per epoch.
WARN_FILE_IMBALANCE = 1.05


def _greedy_assign(shards, num_workers: int) -> tuple[list[list[str]], list[int]]:
    """Largest shard first onto the least-loaded worker (ties: fewer files, then lower index)."""
    files: list[list[str]] = [[] for _ in range(num_workers)]
    loads = [0] * num_workers
    heap = [(0, 0, index) for index in range(num_workers)]
    # Plain tuples: attribute access on 100k pydantic models would dominate the planning time.
    items = sorted((-s.num_records, s.path) for s in shards)
    for negative_records, path in items:
        load, count, index = heap[0]
        files[index].append(path)
        loads[index] = load - negative_records
        heapq.heapreplace(heap, (loads[index], count + 1, index))
    for worker_files in files:
        worker_files.sort()
    return files, loads


def _imbalance(loads: list[int]) -> tuple[float, int]:
    """(max / mean, index of the busiest worker); 1.0 for an empty split."""
    total = sum(loads)
    if total == 0:
        return 1.0, 0
    busiest = max(range(len(loads)), key=lambda i: (loads[i], -i))
    return loads[busiest] * len(loads) / total, busiest


def _normalise_policy(policy: AutoShard | AutoShardPolicy | str) -> AutoShard:
    value = getattr(policy, "value", policy)
    try:
        return AutoShard(value)
    except ValueError:
        allowed = ", ".join(p.value for p in AutoShard)
        raise PlanError(f"train.autoshard ({value!r}) is not a shard policy; use one of {allowed}") from None


def _check_positive(**values: int | None) -> None:
    for name, value in values.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise PlanError(f"plan_shards: {name} ({value!r}) must be an integer ≥ 1")


def plan_shards(
    manifest: Manifest,
    num_workers: int,
    replicas_per_worker: int,
    per_replica_batch_size: int,
    epochs: int,
    steps: int | None = None,
    policy: AutoShard | AutoShardPolicy | str = AutoShard.AUTO,
    split: str = "train",
) -> ShardPlan:
    """Spread one split's shards over the workers and fix the steps every worker runs.

    FILE autosharding (each worker reads only its own files) is chosen when there are at least as
    many files as workers and a greedy largest-first assignment by record count balances them
    (busiest worker ≤ 1.25 × the mean); otherwise DATA (every worker reads every file and keeps its
    1/N slice of the records). `steps_per_epoch` is the same on every worker, because one worker
    running an extra step waits forever in the all-reduce: under FILE it is the least-loaded worker's
    `records // (per_replica_batch_size × replicas_per_worker)`, under DATA `records // global_batch`.

    Args:
        manifest: the dataset manifest; assignments hold its shard paths (relative to the dataset).
        num_workers: training workers (the chief counts as one).
        replicas_per_worker: replicas on each worker (devices mirrored within it).
        per_replica_batch_size: `train.per_replica_batch_size`.
        epochs: `train.epochs`; ignored for total_steps when `steps` is given.
        steps: `train.steps`, the total steps; None: `epochs × steps_per_epoch`.
        policy: `train.autoshard`: AUTO chooses; FILE or DATA forces that policy.
        split: the manifest split to plan ("train").

    Returns:
        The frozen ShardPlan, with warnings naming an overloaded worker.

    Raises:
        PlanError: a count is below 1, the split has no shards, FILE is forced with fewer files than
            workers, or the records do not fill one global batch (0 steps per epoch).
    """
    _check_positive(num_workers=num_workers, replicas_per_worker=replicas_per_worker,
                    per_replica_batch_size=per_replica_batch_size, epochs=epochs, steps=steps)
    wanted = _normalise_policy(policy)
    shards = manifest.shards_for(split)
    if not shards:
        splits = sorted({s.split for s in manifest.shards})
        raise PlanError(f"the manifest of {manifest.dataset_uri} has no {split!r} shards (splits: {splits}); "
                        "convert the data again or plan another split")
    total = sum(s.num_records for s in shards)
    per_worker_batch = global_batch_size(per_replica_batch_size, replicas_per_worker, num_workers=1)
    global_batch = global_batch_size(per_replica_batch_size, replicas_per_worker, num_workers)
    batch_words = (f"{per_replica_batch_size} per replica × {replicas_per_worker} replica(s) × "
                   f"{num_workers} worker(s)")
    warnings: list[str] = []

    file_plan = None
    if len(shards) >= num_workers:
        files, loads = _greedy_assign(shards, num_workers)
        ratio, busiest = _imbalance(loads)
        file_plan = (files, loads, ratio, busiest, min(loads) // per_worker_batch)
    elif wanted == AutoShard.FILE:
        raise PlanError(
            f"train.autoshard 'file' needs at least as many {split} files as workers, but {manifest.dataset_uri} "
            f"has {len(shards)} file(s) for {num_workers} workers; set train.autoshard: data (or auto), or write "
            f"at least {num_workers} shards by lowering data.target_shard_mb"
        )

    use_file = False
    if wanted == AutoShard.FILE:
        use_file = True
    elif wanted == AutoShard.AUTO and file_plan is not None:
        _files, _loads, ratio, busiest, file_steps = file_plan
        if ratio > MAX_FILE_IMBALANCE:
            warnings.append(
                f"worker {busiest} would hold {ratio:.2f}× the mean records under FILE autosharding "
                f"(limit {MAX_FILE_IMBALANCE}); using DATA autosharding, where every worker reads all "
                f"{len(shards)} files; write more, smaller shards (data.target_shard_mb) for FILE"
            )
        elif file_steps == 0:
            # DATA then; if it has no step either, its error names the split's records and the global batch.
            warnings.append(
                f"worker {min(range(num_workers), key=lambda i: _loads[i])} would get {min(_loads)} records "
                f"under FILE autosharding, less than one per-worker batch ({per_worker_batch}); using DATA"
            )
        else:
            use_file = True
    elif wanted == AutoShard.AUTO and num_workers > 1:
        warnings.append(
            f"{len(shards)} {split} file(s) for {num_workers} workers: DATA autosharding, so every worker reads "
            f"every file and keeps 1/{num_workers} of the records; write at least {num_workers} shards (lower "
            "data.target_shard_mb) to let each worker read only its own files"
        )

    if use_file:
        files, loads, ratio, busiest, steps_per_epoch = file_plan
        assignments = tuple(WorkerAssignment(worker_index=w, files=tuple(files[w]), num_records=loads[w])
                            for w in range(num_workers))
        if steps_per_epoch == 0:
            lightest = min(range(num_workers), key=lambda i: (loads[i], i))
            raise PlanError(
                f"worker {lightest} gets {loads[lightest]} {split} records under FILE autosharding, fewer than "
                f"its per-worker batch of {per_worker_batch} ({per_replica_batch_size} per replica × "
                f"{replicas_per_worker} replica(s)): 0 steps per epoch; set train.autoshard: data, lower "
                "train.per_replica_batch_size, or add data"
            )
        if ratio > WARN_FILE_IMBALANCE:
            used = steps_per_epoch * per_worker_batch
            warnings.append(
                f"worker {busiest} holds {ratio:.2f}× the mean records ({loads[busiest]} of {total}); with "
                f"{steps_per_epoch} steps per epoch on every worker it uses {used} of them each epoch; write "
                "more, smaller shards (data.target_shard_mb) or set train.autoshard: data"
            )
        chosen = AutoShardPolicy.FILE
    else:
        all_files = tuple(sorted(s.path for s in shards))
        loads = [len(range(w, total, num_workers)) for w in range(num_workers)]
        ratio, _busiest = _imbalance(loads)
        assignments = tuple(WorkerAssignment(worker_index=w, files=all_files, num_records=loads[w])
                            for w in range(num_workers))
        steps_per_epoch = total // global_batch
        if steps_per_epoch == 0:
            raise PlanError(
                f"the {split} split of {manifest.dataset_uri} has {total} records, fewer than one global batch "
                f"of {global_batch} ({batch_words}): 0 steps per epoch; lower train.per_replica_batch_size, "
                "use fewer workers or replicas, or add data"
            )
        chosen = AutoShardPolicy.DATA

    if steps is not None:
        total_steps = steps
        epochs = -(-steps // steps_per_epoch)
    else:
        total_steps = epochs * steps_per_epoch
    for message in warnings:
        logger.warning("%s", message)
    plan = ShardPlan(
        policy=chosen, num_workers=num_workers, replicas_per_worker=replicas_per_worker,
        per_replica_batch_size=per_replica_batch_size, global_batch_size=global_batch,
        steps_per_epoch=steps_per_epoch, epochs=epochs, total_steps=total_steps, assignments=assignments,
        imbalance_ratio=ratio, warnings=tuple(warnings),
    )
    logger.info("shard plan: %s over %d worker(s), %d file(s), %d steps/epoch, %d total steps, imbalance %.3f",
                chosen.value, num_workers, len(shards), steps_per_epoch, total_steps, ratio)
    return plan


def plan_for_train(manifest: Manifest, train: TrainConfig, replicas_per_worker: int, *,
                   num_workers: int | None = None) -> ShardPlan:
    """`plan_shards` with the sizes a `train` config section asks for (workers, batch, epochs or steps, policy).

    An elastic run (`train.elastic`) is planned DATA: every worker of every attempt reads every file.
    """
    return plan_shards(
        manifest,
        num_workers=num_workers or train.workers,
        replicas_per_worker=replicas_per_worker,
        per_replica_batch_size=train.per_replica_batch_size,
        epochs=train.epochs,
        steps=train.steps,
        policy=AutoShard.DATA if train.elastic is not None else train.autoshard,
    )


def plan_to_markdown(plan: ShardPlan, max_files: int = 4) -> str:
    """The plan as markdown (a Prefect or MLflow artifact): the summary, one row per worker, the warnings.

    Args:
        plan: the shard plan.
        max_files: file names listed per worker before "… and N more".
    """
    lines = [
        "# Shard plan",
        "",
        "| setting | value |",
        "|---|---|",
        f"| policy | {plan.policy.value} |",
        f"| workers | {plan.num_workers} |",
        f"| replicas per worker | {plan.replicas_per_worker} |",
        f"| per-replica batch | {plan.per_replica_batch_size} |",
        f"| global batch | {plan.global_batch_size} |",
        f"| steps per epoch (every worker) | {plan.steps_per_epoch} |",
        f"| epochs | {plan.epochs} |",
        f"| total steps | {plan.total_steps} |",
        f"| imbalance (max / mean records) | {plan.imbalance_ratio:.3f} |",
        "",
        "| worker | files | records per epoch | first files |",
        "|---|---|---|---|",
    ]
    for assignment in plan.assignments:
        shown = ", ".join(f"`{f}`" for f in assignment.files[:max_files])
        more = len(assignment.files) - max_files
        if more > 0:
            shown += f" … and {more} more"
        lines.append(f"| {assignment.worker_index} | {len(assignment.files)} | {assignment.num_records} | {shown} |")
    if plan.warnings:
        lines += ["", "## Warnings", ""] + [f"- {w}" for w in plan.warnings]
    return "\n".join(lines) + "\n"
