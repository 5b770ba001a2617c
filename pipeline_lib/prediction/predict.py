"""Batch scoring: a model on every row of a table of any size, chunk by chunk, into a Parquet or CSV file."""

from __future__ import annotations

import logging
import time

from pipeline_lib.config import DataEngine, PredictConfig
from pipeline_lib.core.secrets import mask_url_passwords
from pipeline_lib.prediction import tables
from pipeline_lib.prediction.models import open_model
from pipeline_lib.prediction.scoring import (
    BadRows,
    PredictResult,
    open_scorer,
    resolved_tracking_uri,
    run_record,
    score_into,
)

logger = logging.getLogger(__name__)


def predict(config: PredictConfig) -> PredictResult:
    """Score every row of `config.input` with `config.model` into `config.output`, in bounded memory.

    The input is read `batch_rows` rows at a time (one file after another, each in order); while the model scores
    one chunk, the next is read and converted on a helper thread and the previous one is written on another, so
    at most three chunks are held (the overlap scores more rows/s than doing the three in turn: bench/bench_scoring.py).
    The output holds the kept columns, `prediction` and, for classification,
    `probability_<class>`, in input order; it appears at OUTPUT only once every row is written.

    Raises:
        PredictionError: the model or a column cannot be found, or (on_bad_record: fail) a row is bad: one line
            naming the file, line or row, column and value.
    """
    if config.engine == DataEngine.RAY:  # Ray is imported only when a config asks for it
        from pipeline_lib.prediction.ray_engine import predict_on_ray

        return predict_on_ray(config)
    started = time.perf_counter()
    fmt = tables.output_format(config)
    with open_model(config.model, tracking_uri=resolved_tracking_uri(config),
                    storage_options=config.storage_options) as (model, local):
        scorer = open_scorer(config, local)
        bad = BadRows(config.on_bad_record)
        writer = tables.OutputWriter(config.output, fmt, config.storage_options)
        try:
            num_rows, num_chunks = score_into(
                writer, scorer, tables.read_chunks(config, scorer.columns, scorer.spec["label"]["name"]), bad,
                config.keep)
            seconds = time.perf_counter() - started
            writer.commit(run_record(config, model, num_rows, bad))
        except BaseException:
            writer.abort()
            raise
    result = PredictResult(model=model, input=mask_url_passwords(config.input), output=mask_url_passwords(
        config.output), output_format=fmt, num_rows=num_rows, num_skipped=bad.count, bad_samples=bad.samples,
        num_chunks=num_chunks, batch_rows=config.batch_rows, seconds=round(seconds, 3))
    logger.debug("%s", result.summary_line())
    return result
