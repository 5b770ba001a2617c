"""Heartbeat files: each training process writes its step and phase, the supervisor's watchdog reads them."""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any

from pipeline_lib.cluster.info import ClusterInfo
from pipeline_lib.training.hooks import MetricsSink, Phase

HEARTBEAT_INTERVAL_S = 0.5


def heartbeat_name(cluster: ClusterInfo) -> str:
    """The heartbeat file name of a task: `worker-1.json`, `chief-0.json`."""
    return f"{cluster.task_type}-{cluster.task_index}.json"


class Heartbeat:
    """Writes `<heartbeat_dir>/<task>.json` with step, phase, time and examples, at most every `interval_s`.

    A phase change is always written. `start_step` is the step the task restored (None until it has).
    Written atomically (temp file + rename) so the supervisor never reads half a file.
    """

    def __init__(self, heartbeat_dir: str, cluster: ClusterInfo, interval_s: float = HEARTBEAT_INTERVAL_S):
        os.makedirs(heartbeat_dir, exist_ok=True)
        self.path = os.path.join(heartbeat_dir, heartbeat_name(cluster))
        self.task = cluster.name
        self.interval_s = interval_s
        self.examples = 0
        self.phase = Phase.STARTING
        self.start_step: int | None = None
        self.loss: float | None = None
        self.metrics: dict[str, Any] | None = None  # the task's Prometheus endpoint: {"target", "labels"}
        self.eval_metrics: dict[str, float] = {}  # the chief's latest checkpoint evaluation (for progress displays)
        self._last_write = float("-inf")

    def beat(self, step: int, examples: int, *, phase: Phase | None = None, force: bool = False,
             loss: float | None = None) -> None:
        self.examples += examples
        if loss is not None and math.isfinite(loss):
            self.loss = float(loss)
        if phase is not None and phase != self.phase:
            self.phase, force = phase, True
        now = time.monotonic()
        if not force and now - self._last_write < self.interval_s:
            return
        self._last_write = now
        payload = json.dumps({"task": self.task, "pid": os.getpid(), "step": int(step), "phase": self.phase.value,
                              "start_step": self.start_step, "time": time.time(), "examples": int(self.examples),
                              "loss": self.loss, "metrics": self.metrics, "eval": self.eval_metrics})
        tmp = f"{self.path}.{os.getpid()}.tmp"
        with open(tmp, "w") as handle:
            handle.write(payload)
        os.replace(tmp, self.path)


class EvalOnHeartbeat:
    """A metrics sink that passes everything to `sink` and keeps the latest `eval_*` metrics on the heartbeat, so
    the supervisor's progress reports carry the chief's latest evaluation without reading checkpoints."""

    def __init__(self, sink: MetricsSink, heartbeat: Heartbeat):
        self.sink, self.heartbeat = sink, heartbeat

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        evaluated = {k: float(v) for k, v in metrics.items() if k.startswith("eval_") and math.isfinite(v)}
        if evaluated:
            self.heartbeat.eval_metrics = evaluated
        self.sink.log_metrics(metrics, step)

    def flush(self) -> None:
        self.sink.flush()


def read_heartbeat(path: str) -> dict[str, Any] | None:
    """One heartbeat file's content, or None when it is missing or unreadable."""
    try:
        with open(path) as handle:
            return json.loads(handle.read())
    except (OSError, ValueError):
        return None
