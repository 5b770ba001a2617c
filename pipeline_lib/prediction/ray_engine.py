"""Batch scoring on a Ray cluster (`tfdag predict --engine ray`): a pool of actors, each holding the model, scores
the input's files and Parquet row-group runs (`data.ray_engine.work_units`) into a directory of parts.

OUTPUT becomes a directory: `part-<n>.parquet` (or `.csv`) per unit, named by the unit's place in the input, then
`_tfdag_predict.json` last, holding what a single output file carries (the model, the input, rows and skipped
rows) and the parts. Without the marker a directory is no output. Reading the parts in name order gives the local
engine's rows and predictions.

Each part is written beside its final name and renamed (uploaded once, on object storage), so a part is whole or
absent. An actor lost with its node is restarted on a node that fits and its part given to it again
(ACTOR_RESTARTS): the part is scored again under the same name, never twice.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from pipeline_lib.cluster.ray_connect import (
    connect,
    node_name,
    on_this_node,
    ray_module,
    resource_options,
    task_error,
)
from pipeline_lib.config import PredictConfig
from pipeline_lib.core import storage
from pipeline_lib.core.errors import TfdagError
from pipeline_lib.core.secrets import mask_url_passwords
from pipeline_lib.data.bad_records import MAX_BAD_SAMPLES
from pipeline_lib.data.ray_engine import WorkUnit, work_units
from pipeline_lib.data.sources import list_source
from pipeline_lib.prediction import tables
from pipeline_lib.prediction.models import PredictionError, ResolvedModel, open_model
from pipeline_lib.prediction.scoring import (
    BadRows,
    PredictResult,
    open_scorer,
    resolved_tracking_uri,
    run_record,
    score_into,
)

logger = logging.getLogger(__name__)

ENGINE = "ray"
ACTOR_RESTARTS = 3  # an actor lost with its node is started again, and its part given again, this many times


@dataclass
class PartResult:
    """What one actor call scored into one part."""

    index: int
    path: str  # relative to OUTPUT
    num_rows: int
    num_chunks: int
    num_skipped: int
    bad_samples: list[str]
    model: ResolvedModel
    node: str


class ScoringActor:
    """One actor of the pool: the model opened once (downloaded, for an MLflow URI), then part after part."""

    def __init__(self, config: PredictConfig, tracking_uri: str | None):
        self.config = config
        self._model = contextlib.ExitStack()
        self.error: TfdagError | None = None  # a model that cannot be opened: raised by the first call
        try:
            self.model, saved_model_dir = self._model.enter_context(
                open_model(config.model, tracking_uri=tracking_uri, storage_options=config.storage_options))
            self.scorer = open_scorer(config, saved_model_dir)
        except TfdagError as error:
            self.error = error
            return
        self.data = tables.input_data(config, self.scorer.spec["label"]["name"])
        self.fs, _ = storage.get_fs(config.input, dict(config.storage_options))

    def score(self, unit: WorkUnit, output: str, relative: str) -> PartResult:
        if self.error is not None:
            raise self.error
        config = self.config
        bad = BadRows(config.on_bad_record)
        writer = tables.OutputWriter(storage.join(output, relative), tables.output_format(config),
                                     config.storage_options)
        try:
            chunks = tables.file_chunks(config, self.data, self.fs, unit.file, self.scorer.columns, unit.row_groups)
            num_rows, num_chunks = score_into(writer, self.scorer, chunks, bad, config.keep)
            writer.commit(None)
        except PredictionError as error:
            writer.abort()
            raise on_this_node(error) from None
        except BaseException:
            writer.abort()
            raise
        return PartResult(unit.index, relative, num_rows, num_chunks, bad.count, bad.samples, self.model, node_name())


def predict_on_ray(config: PredictConfig) -> PredictResult:
    """Score INPUT into the directory OUTPUT with actors on the Ray cluster of `config.ray` (see the module).

    Raises:
        RayClusterError: no Ray cluster answers at ray.address (or RAY_ADDRESS).
        PredictionError: the model or a column cannot be found, or (on_bad_record: fail) a row is bad: one line
            naming the file, line or row, column, value and node.
    """
    started = time.perf_counter()
    fmt = tables.output_format(config)
    ray = ray_module()
    connect(config.ray.cluster())
    # References (${NAME}) resolve here, where they are set; the actors get the values as arguments, in memory.
    expanded = config.model_copy(update={"storage_options": storage.expand_env(dict(config.storage_options))})
    tracking_uri = resolved_tracking_uri(config)
    fs, files = list_source(tables.input_data(expanded, label=""))
    units = work_units(fs, files)
    out_fs, out_path = storage.get_fs(config.output, expanded.storage_options)
    if out_fs.exists(out_path):  # a rerun replaces the output: its marker goes first, so no reader sees a mix
        with contextlib.suppress(FileNotFoundError):
            out_fs.rm(storage.join(out_path, tables.PARTS_MARKER))
        out_fs.rm(out_path, recursive=True)
    out_fs.makedirs(out_path, exist_ok=True)
    pool = _start_pool(ray, expanded, tracking_uri, len(units))
    try:
        results = _score_all(ray, pool, units, config.output, fmt.value)
        if storage.is_local(config.output):  # parts an actor lost with its node had begun
            for left in out_fs.glob(storage.join(out_path, ".part-*.tmp")):
                out_fs.rm(left)
        record = _record(config, results, fmt.value)
        storage.write_bytes_atomic(out_fs, storage.join(out_path, tables.PARTS_MARKER),
                                   (json.dumps(record, sort_keys=True, default=str) + "\n").encode())
    except BaseException:
        with contextlib.suppress(Exception):
            out_fs.rm(out_path, recursive=True)
        raise
    finally:
        for actor in pool:
            ray.kill(actor)
    result = PredictResult(
        model=results[0].model, input=mask_url_passwords(config.input), output=mask_url_passwords(config.output),
        output_format=fmt, num_rows=record["rows"], num_skipped=record["skipped_rows"],
        bad_samples=record["bad_samples"], num_chunks=sum(r.num_chunks for r in results),
        batch_rows=config.batch_rows, seconds=round(time.perf_counter() - started, 3), engine=ENGINE,
        nodes=record["nodes"])
    logger.debug("%s", result.summary_line())
    return result


def _start_pool(ray, config: PredictConfig, tracking_uri: str | None, num_units: int) -> list[Any]:
    resources = config.ray.resources_per_actor
    actors = config.ray.actors
    if actors is None:  # as many as the cluster holds, one part each at most
        total = ray.cluster_resources()
        actors = min(int(total.get(name, 0.0) // amount) for name, amount in resources.items() if amount > 0)
    actors = max(1, min(actors, num_units))
    remote = ray.remote(ScoringActor).options(**resource_options(resources), max_restarts=ACTOR_RESTARTS,
                                              max_task_retries=ACTOR_RESTARTS)
    logger.info("predict | %d part(s) on %d Ray actor(s) of %s each", num_units, actors, resources)
    return [remote.remote(config, tracking_uri) for _ in range(actors)]


def _score_all(ray, pool: list[Any], units: list[WorkUnit], output: str, extension: str) -> list[PartResult]:
    """Every unit scored by the next free actor; the first failure of ours is raised (its cause).

    A call cut off by its actor's loss (the actor unavailable or dead, the node gone) is given again, to the same
    actor, which Ray restarts on a node that fits, up to ACTOR_RESTARTS times a unit: a part is written whole under
    its own name, so scoring it again replaces it, never adds to it.
    """
    waiting = collections.deque(units)
    running: dict[Any, tuple[Any, WorkUnit]] = {}
    lost: collections.Counter[int] = collections.Counter()

    def give(actor, unit: WorkUnit | None = None) -> None:
        if unit is None and waiting:
            unit = waiting.popleft()
        if unit is not None:
            running[actor.score.remote(unit, output, f"part-{unit.index:05d}.{extension}")] = (actor, unit)

    for actor in pool:
        give(actor)
    results = []
    while running:
        (ref,), _ = ray.wait(list(running), num_returns=1)
        actor, unit = running.pop(ref)
        try:
            results.append(ray.get(ref))
        except ray.exceptions.RayTaskError as error:
            raise task_error(error) from None
        except ray.exceptions.RayError as error:
            lost[unit.index] += 1
            if lost[unit.index] > ACTOR_RESTARTS:
                raise PredictionError(
                    f"Ray lost the scoring of {unit.describe()} {lost[unit.index]} times "
                    f"(last: {type(error).__name__}: {str(error).splitlines()[0]}); check the cluster's nodes "
                    "(`ray status`) and score again") from None
            logger.warning("predict | %s lost (%s); scoring it again", unit.describe(), type(error).__name__)
            give(actor, unit)
            continue
        give(actor)
    return sorted(results, key=lambda r: r.index)


def _record(config: PredictConfig, results: list[PartResult], extension: str) -> dict[str, Any]:
    bad = BadRows(config.on_bad_record)
    bad.count = sum(r.num_skipped for r in results)
    bad.samples = [s for r in results for s in r.bad_samples][:MAX_BAD_SAMPLES]
    nodes: dict[str, int] = {}
    for result in results:
        nodes[result.node] = nodes.get(result.node, 0) + 1
    return {**run_record(config, results[0].model, sum(r.num_rows for r in results), bad), "engine": ENGINE,
            "format": extension, "nodes": nodes, "parts": [{"path": r.path, "rows": r.num_rows} for r in results]}
