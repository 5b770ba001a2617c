"""The MLflow metrics sink and the one factory that picks a run's sink."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

from pipeline_lib.tracking.client import create_client
from pipeline_lib.training.hooks import MetricsSink, NullSink

logger = logging.getLogger(__name__)

# MLflow's own limit (mlflow.utils.validation), and what a sink keeps while the store is away.
_MAX_METRICS_PER_BATCH = 1000
_MAX_BUFFERED_METRICS = 100_000
# How often the chief samples CPU, memory, disk and network (and GPUs where present) for MLflow's System metrics.
SYSTEM_METRICS_INTERVAL_S = 2.0
# The loop's per-checkpoint evaluation (`eval_accuracy` at each checkpoint) is a curve, not the run's result: in MLflow
# it is logged as `checkpoint/eval_accuracy`, so the metrics table never shows the last checkpoint's value under a
# name a reader takes for the exported model's (that is `final_eval_accuracy`, linked to the logged model).
CHECKPOINT_METRIC_PREFIX = "checkpoint/"


def mlflow_metric_name(name: str) -> str:
    """The MLflow name of a metric the training loop reports: `eval_*` → `checkpoint/eval_*`, others unchanged."""
    return f"{CHECKPOINT_METRIC_PREFIX}{name}" if name.startswith("eval_") else name


class MlflowSink:
    """A MetricsSink that buffers metrics and sends them to one MLflow run with batched `log_batch` calls."""

    def __init__(self, run_id: str, tracking_uri: str, flush_every: int = 50):
        if flush_every < 1:
            raise ValueError(f"flush_every ({flush_every}) must be ≥ 1")
        self.run_id = run_id
        self.tracking_uri = tracking_uri
        self.flush_every = flush_every
        self._client = create_client(tracking_uri)
        self._pending: list[Any] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        timestamp = int(time.time() * 1000)
        for name, value in metrics.items():
            self._pending.append(Metric(key=mlflow_metric_name(name), value=float(value), timestamp=timestamp,
                                       step=int(step)))
        if len(self._pending) >= self.flush_every:
            self.flush()

    def flush(self) -> None:
        """Send every buffered value; on a store error keep them for the next flush, so training goes on."""
        while self._pending:
            chunk = self._pending[:_MAX_METRICS_PER_BATCH]
            try:
                self._client.log_batch(self.run_id, metrics=chunk, synchronous=True)
            except Exception as error:  # noqa: BLE001 - a locked sqlite file or a server blip must not stop training
                dropped = max(0, len(self._pending) - _MAX_BUFFERED_METRICS)
                self._pending = self._pending[dropped:]
                logger.warning("MLflow run %s: %d metric value(s) not logged yet (%s); retrying at the next flush%s",
                               self.run_id, len(self._pending), error,
                               f", {dropped} oldest dropped" if dropped else "")
                return
            self._pending = self._pending[len(chunk):]


def create_sink(run_id: str | None, tracking_uri: str, *, is_chief: bool = True,
                flush_every: int = 50) -> MetricsSink:
    """An MlflowSink on the chief of a tracked run; a NullSink without a run id (tracking disabled) or off the chief."""
    if not run_id or not is_chief:
        return NullSink()
    return MlflowSink(run_id, tracking_uri, flush_every)


@contextlib.contextmanager
def system_metrics(run_id: str | None, tracking_uri: str, *, is_chief: bool = True,
                   interval_s: float = SYSTEM_METRICS_INTERVAL_S) -> Iterator[None]:
    """MLflow's system metrics (`system/cpu_utilization_percentage`, memory, disk, network; GPU where present)
    sampled on the chief while the block runs, shown in the run's System metrics tab; nothing without a run or off
    the chief. A block shorter than one interval still logs one sample; a monitoring failure never stops training.
    """
    if not run_id or not is_chief:
        yield
        return
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    monitor = None
    try:
        # resume_logging: a restarted chief continues the steps of the one before it.
        monitor = SystemMetricsMonitor(run_id, sampling_interval=interval_s, samples_before_logging=1,
                                       resume_logging=True, tracking_uri=tracking_uri)
        first_step = monitor._logging_step
        monitor.start()
    except Exception as error:  # noqa: BLE001 - see the docstring
        logger.warning("system metrics are not logged to MLflow run %s: %s", run_id, error)
    try:
        yield
    finally:
        if monitor is not None:
            try:
                monitor.finish()
                if monitor._logging_step == first_step:
                    monitor.collect_metrics()
                    monitor.publish_metrics(monitor.aggregate_metrics())
                    monitor.mlflow_logger.flush()
            except Exception as error:  # noqa: BLE001 - see the docstring
                logger.warning("system metrics of MLflow run %s not flushed: %s", run_id, error)
