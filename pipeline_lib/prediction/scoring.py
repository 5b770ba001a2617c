"""Scoring chunks, what both engines share: the scorer, the bad rows, the loop that scores chunks into an output
writer, and the record an output keeps of its run."""

from __future__ import annotations

import concurrent.futures
import datetime
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
from pydantic import BaseModel, ConfigDict

from pipeline_lib.config import OnBadRecord, OutputFormat, PredictConfig
from pipeline_lib.core import storage
from pipeline_lib.core.secrets import mask_url_passwords
from pipeline_lib.data.bad_records import MAX_BAD_SAMPLES, bad_message
from pipeline_lib.data.readers.base import read_ahead
from pipeline_lib.prediction import tables
from pipeline_lib.prediction.models import PredictionError, ResolvedModel
from pipeline_lib.serving.tfdag_scoring import RawRowError, Scorer

logger = logging.getLogger(__name__)


class PredictResult(BaseModel):
    """What one batch-scoring run did (`tfdag predict --json` prints it)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: ResolvedModel
    input: str
    output: str
    output_format: OutputFormat
    num_rows: int  # rows scored (and written)
    num_skipped: int  # bad rows skipped (on_bad_record: skip)
    bad_samples: list[str] = []  # the first few skipped rows, each naming its file, line or row, and column
    num_chunks: int
    batch_rows: int
    seconds: float
    engine: str = "local"
    nodes: dict[str, int] = {}  # engine ray: the parts each Ray node scored

    @property
    def rows_per_second(self) -> float:
        return self.num_rows / self.seconds if self.seconds > 0 else 0.0

    def summary_line(self) -> str:
        return (f"predict | rows: {self.num_rows} | skipped: {self.num_skipped} | seconds: {self.seconds:.2f} | "
                f"rows/s: {self.rows_per_second:,.0f} | model: {self.model.describe()} | output: {self.output}")


@dataclass
class BadRows:
    on_bad_record: OnBadRecord
    count: int = 0
    samples: list[str] = field(default_factory=list)

    def handle(self, chunk: tables.Chunk, problems: dict[int, RawRowError]) -> np.ndarray | None:
        """The rows of `chunk` to score (None: all), after failing on the first bad row or counting them."""
        raw = chunk.raw
        found = [(position, bad_message(raw, position, None, None, why)) for position, why in raw.structural]
        found += [(raw.position(row), bad_message(raw, raw.position(row), error.column, error.value, error.reason))
                  for row, error in problems.items()]
        if not found:
            return None
        found.sort()
        if self.on_bad_record == OnBadRecord.FAIL:
            raise PredictionError(f"bad record: {found[0][1]}; fix the input, or pass --on-bad-record skip "
                                  "(on_bad_record: skip) to score the other rows and count the bad ones")
        self.count += len(found)
        for _position, message in found[: max(0, MAX_BAD_SAMPLES - len(self.samples))]:
            self.samples.append(message)
            logger.warning("predict | skipping bad record: %s", message)
        keep = np.ones(len(chunk.frame), dtype=bool)
        keep[list(problems)] = False
        return keep


def resolved_tracking_uri(config: PredictConfig) -> str | None:
    """The MLflow store of an MLflow model URI: `${NAME}` references (a password) resolved here, where it is opened."""
    return (storage.expand_env(config.tracking_uri, "tracking_uri") if config.tracking_uri
            else os.environ.get("MLFLOW_TRACKING_URI"))


def open_scorer(config: PredictConfig, saved_model_dir: str) -> Scorer:
    """The model's scorer, once the kept columns are known not to clash with its outputs."""
    scorer = Scorer(saved_model_dir, batch_rows=config.batch_rows)
    clash = [name for name in config.keep if name in scorer.output_columns()]
    if clash:
        raise PredictionError(f"keep names {clash}, which the output has as predictions; keep other columns")
    return scorer


def score_into(writer: tables.OutputWriter, scorer: Scorer, chunks: Iterator[tables.Chunk], bad: BadRows,
               keep: tuple[str, ...]) -> tuple[int, int]:
    """Score `chunks` into `writer` (rows and chunks scored): while the model scores one chunk, the next is read and
    converted on a helper thread and the previous one is written on another, so at most three chunks are held."""
    num_rows = num_chunks = 0
    prepared = read_ahead(_prepare(scorer, chunks))
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tfdag-write") as output:
        pending: concurrent.futures.Future | None = None
        for chunk, tensors, problems in prepared:
            kept = bad.handle(chunk, problems)
            if kept is not None:
                tensors = {name: values[kept] for name, values in tensors.items()}
            table = _output_table(scorer, chunk, kept, scorer.predict_tensors(tensors))
            if pending is not None:
                pending.result()  # one chunk being written at a time: memory stays bounded
            pending = output.submit(writer.write, table)
            num_rows += table.num_rows
            num_chunks += 1
        if pending is not None:
            pending.result()
    if num_chunks == 0 or writer.schema is None:  # no rows: the file still has the columns
        writer.write(_empty_table(scorer, keep))
    return num_rows, num_chunks


def run_record(config: PredictConfig, model: ResolvedModel, num_rows: int, bad: BadRows) -> dict[str, Any]:
    """What the output keeps of its run: the model, the input, the rows scored and skipped."""
    return {"model": model.model_dump(mode="json"), "input": mask_url_passwords(config.input),
            "rows": num_rows, "skipped_rows": bad.count, "bad_samples": bad.samples,
            "batch_rows": config.batch_rows, "keep": list(config.keep),
            "created_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}


def _prepare(scorer: Scorer, chunks: Iterator[tables.Chunk]):
    """Each chunk with its model inputs and bad values: runs on the read-ahead thread, beside the scoring."""
    for chunk in chunks:
        tensors, problems = scorer.convert(chunk.frame)
        yield chunk, tensors, problems


def _output_table(scorer: Scorer, chunk: tables.Chunk, keep: np.ndarray | None, outputs) -> pa.Table:
    mask = None if keep is None else pa.array(keep)
    kept = {name: (values if mask is None else values.filter(mask)) for name, values in chunk.kept.items()}
    return pa.table({**kept, **{name: pa.array(values) for name, values in scorer.output_arrays(outputs).items()}})


def _empty_table(scorer: Scorer, keep: tuple[str, ...]) -> pa.Table:
    empty = {column["name"]: np.zeros((0, *column["shape"]), np.float32) if column["dtype"] != "string"
             else np.zeros((0, *column["shape"]), object) for column in scorer.columns}
    predictions = scorer.output_arrays(scorer.predict_tensors(empty))
    return pa.table({**{name: pa.nulls(0) for name in keep}, **{name: pa.array(v) for name, v in predictions.items()}})
