"""Prometheus metrics of a run while it happens: an endpoint on every training task and one on the supervisor, and
a `file_sd` targets file so a Prometheus server finds them. The endpoints end with their processes and the targets
file is emptied at the end: nothing lingers (unlike a Pushgateway).

Every series is labelled `run`, `task_type`, `task_index`. Tasks: `tfdag_steps_total`, `tfdag_examples_total`,
`tfdag_step_seconds` (histogram), `tfdag_input_wait_seconds` (histogram: each step's wait for its batch, the
input-bound signal), `tfdag_examples_per_second`, `tfdag_loss`, `tfdag_learning_rate`, `tfdag_gradient_norm`,
`tfdag_heartbeat_age_seconds`, `tfdag_checkpoint_seconds` (histogram), `tfdag_last_checkpoint_timestamp_seconds`.
Supervisor: `tfdag_restarts_total`, `tfdag_worker_step_lag` (each worker's steps behind the fastest), `tfdag_workers`
(the current attempt's training workers).
"""

from __future__ import annotations

import json
import logging
import math
import socket
import threading
import time
from collections.abc import Mapping
from typing import Any

from pipeline_lib.core import storage
from pipeline_lib.training.hooks import Execution

logger = logging.getLogger(__name__)

TARGETS_NAME = "prometheus_targets.json"  # in the run directory, Prometheus file_sd format
LABELS = ("run", "task_type", "task_index")
_INPUT_WAIT_BUCKETS = (0.00001, 0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)
_STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_CHECKPOINT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


# How often an endpoint's thread looks for a shutdown request: `close()` waits up to this long. prometheus_client's
# `start_http_server` serves at socketserver's default 0.5 s poll, which the end of every launch (every tuning trial's
# too) would wait out.
_SHUTDOWN_POLL_S = 0.05


def _serve(registry: Any, host: str, port: int) -> tuple[Any, int]:
    """`prometheus_client.start_http_server` (its WSGI app on a threading server, quiet, on a daemon thread), with a
    prompt shutdown."""
    from socketserver import ThreadingMixIn
    from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

    from prometheus_client import make_wsgi_app

    class Server(ThreadingMixIn, WSGIServer):
        address_family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        daemon_threads = True

    class QuietHandler(WSGIRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = make_server(host, port, make_wsgi_app(registry), Server, handler_class=QuietHandler)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": _SHUTDOWN_POLL_S},
                     name="tfdag-prometheus", daemon=True).start()
    return server, int(server.server_address[1])


class TaskMetrics:
    """The metrics endpoint of one training task; the worker's hooks feed it."""

    def __init__(self, run: str, task_type: str, task_index: int, host: str, port: int = 0):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        self.labels = {"run": run, "task_type": task_type, "task_index": str(task_index)}

        def make(kind, name, doc, **kwargs):
            return kind(name, doc, list(LABELS), registry=self.registry, **kwargs).labels(**self.labels)

        self.steps = make(Counter, "tfdag_steps", "Training steps this task has run (this process)")
        self.examples = make(Counter, "tfdag_examples", "Examples of those steps, over all replicas")
        self.step_seconds = make(Histogram, "tfdag_step_seconds", "Wall seconds per step (input included)",
                                 buckets=_STEP_BUCKETS)
        self.input_wait_seconds = make(Histogram, "tfdag_input_wait_seconds",
                                       "Seconds each step waited for its batch (the input-bound signal)",
                                       buckets=_INPUT_WAIT_BUCKETS)
        self.examples_per_second = make(Gauge, "tfdag_examples_per_second", "Examples per second, last execution")
        self.loss = make(Gauge, "tfdag_loss", "Training loss of the last step")
        self.learning_rate = make(Gauge, "tfdag_learning_rate", "The optimizer's learning rate")
        self.gradient_norm = make(Gauge, "tfdag_gradient_norm", "Mean global gradient norm of the last execution")
        self.checkpoint_seconds = make(Histogram, "tfdag_checkpoint_seconds",
                                       "Seconds per checkpoint (save, evaluation, upload)", buckets=_CHECKPOINT_BUCKETS)
        self.last_checkpoint = make(Gauge, "tfdag_last_checkpoint_timestamp_seconds",
                                    "Unix time of the last checkpoint saved")
        self._last_beat = time.time()
        make(Gauge, "tfdag_heartbeat_age_seconds", "Seconds since this task last made progress").set_function(
            lambda: time.time() - self._last_beat)
        self.server, self.port = _serve(self.registry, host, port)
        self.target = f"{host}:{self.port}"

    def beat(self) -> None:
        self._last_beat = time.time()

    def on_execution(self, execution: Execution) -> None:
        self.beat()
        steps, seconds = execution.steps, execution.seconds
        self.steps.inc(steps)
        self.examples.inc(execution.examples)
        if steps and seconds > 0:
            per_step = seconds / steps
            for _ in range(steps):
                self.step_seconds.observe(per_step)
            self.examples_per_second.set(execution.examples / seconds)
        for wait in execution.input_waits_s:
            self.input_wait_seconds.observe(max(wait, 0.0))
        for gauge, value in ((self.loss, execution.loss), (self.learning_rate, execution.learning_rate),
                             (self.gradient_norm, execution.gradient_norm)):
            if math.isfinite(value):
                gauge.set(value)

    def on_checkpoint(self, seconds: float) -> None:
        self.beat()
        self.checkpoint_seconds.observe(seconds)
        self.last_checkpoint.set(time.time())

    def endpoint(self) -> dict[str, Any]:
        """Where this endpoint is, for the supervisor's targets file (it travels in the task's heartbeat)."""
        return {"target": self.target, "labels": dict(self.labels)}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class SupervisorMetrics:
    """The supervisor's endpoint: restarts and the straggler signal, and the run's targets file."""

    def __init__(self, run: str, host: str, port: int, targets_uri: str,
                 storage_options: Mapping[str, Any] | None = None):
        from prometheus_client import CollectorRegistry, Counter, Gauge

        self.registry = CollectorRegistry()
        self.run = run
        labels = {"run": run, "task_type": "supervisor", "task_index": "0"}
        self.restarts = Counter("tfdag_restarts", "Restarts of the training group", list(LABELS),
                                registry=self.registry).labels(**labels)
        self.workers = Gauge("tfdag_workers", "Training workers of the current attempt (an elastic run resizes)",
                             list(LABELS), registry=self.registry).labels(**labels)
        self.lag = Gauge("tfdag_worker_step_lag", "Steps each worker is behind the fastest", list(LABELS),
                         registry=self.registry)
        self.server, self.port = _serve(self.registry, host, port)
        self.target = {"targets": [f"{host}:{self.port}"], "labels": labels}
        self.targets_uri = targets_uri
        self.storage_options = dict(storage_options or {})
        self._written: list[dict[str, Any]] | None = None

    def set_lag(self, steps: Mapping[tuple[str, int], int]) -> None:
        """`steps`: (task_type, task_index) → its latest step."""
        if not steps:
            return
        fastest = max(steps.values())
        for (task_type, task_index), step in steps.items():
            self.lag.labels(run=self.run, task_type=task_type, task_index=str(task_index)).set(fastest - step)

    def write_targets(self, endpoints: list[Mapping[str, Any]]) -> None:
        """The supervisor and every task endpoint known (`TaskMetrics.endpoint()`), in Prometheus file_sd format
        (rewritten when it changes)."""
        groups = [self.target]
        for found in sorted(endpoints, key=lambda e: str(e.get("target"))):
            if found.get("target") and isinstance(found.get("labels"), Mapping):
                groups.append({"targets": [str(found["target"])], "labels": dict(found["labels"])})
        self._write(groups)

    def _write(self, groups: list[dict[str, Any]]) -> None:
        if groups == self._written:
            return
        fs, path = storage.get_fs(self.targets_uri, self.storage_options)
        storage.write_bytes_atomic(fs, path, json.dumps(groups, indent=2).encode())
        self._written = groups

    def close(self) -> None:
        """Empty the targets file (the run's endpoints are gone) and stop the endpoint."""
        try:
            self._write([])
        except Exception as error:  # noqa: BLE001 - the targets file must not hide how training ended
            logger.warning("prometheus targets %s not emptied: %s", self.targets_uri, error)
        self.server.shutdown()
        self.server.server_close()
