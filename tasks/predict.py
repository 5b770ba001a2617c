"""The batch-scoring task: one table scored by one model (`pipeline_lib.prediction.predict`)."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from pipeline_lib.config import PredictConfig
from pipeline_lib.prediction.predict import predict
from pipeline_lib.prediction.scoring import PredictResult
from tasks.retry import transient_retries


@task(cache_policy=NO_CACHE, name="predict_table", **transient_retries())
def predict_table(config: PredictConfig) -> PredictResult:
    """A storage outage or an MLflow server that does not answer is retried: the output appears whole or not at all,
    so a retry starts clean."""
    result = predict(config)
    logger = get_run_logger()
    for sample in result.bad_samples:
        logger.warning("skipped bad record: %s", sample)
    logger.info("%s", result.summary_line())
    return result
