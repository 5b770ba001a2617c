"""The worker entry point (`tfdag worker --spec SPEC_URI`): one task of a training cluster, local or in a pod.

A worker reads TF_CONFIG from the environment and a `WorkerSpec` JSON from a path or fsspec URI, splits
the CPU into logical devices before TensorFlow starts, runs the cross-worker preflight when it is
available, then either trains (the chief and the workers of a synchronous strategy, the chief/coordinator
under parameter_server) or serves (ps and worker tasks under parameter_server).

Exit codes:
    0: training finished (the chief wrote `<run_dir>/result.json`).
    1: a Python exception; the traceback is on stderr. Permanent: restarting will not help.
    PREEMPTION_EXIT_CODE (138): SIGTERM (a preemption notice) was received; a checkpoint agreed by every
        worker was saved first. Retryable: restart the group and it resumes from that checkpoint.

This module imports TensorFlow only inside `worker_main`, so the launcher can import it cheaply.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
import traceback
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict

from pipeline_lib.cluster.validation import ClusterInfo, cluster_from_env
from pipeline_lib.config import PipelineConfig, Strategy, parse_config
from pipeline_lib.core import storage
from pipeline_lib.planning.sharding import ShardPlan
from pipeline_lib.testing import faults

logger = logging.getLogger(__name__)

# 138 = 128 + SIGUSR1: the exit code Kubeflow's TFJob `restartPolicy: ExitCode` reserves for user-defined
# retryable errors (kubeflow/training-operator train_util.IsRetryableExitCode), so a TFJob restarts a
# preempted pod just as our launcher does. 1 (exception) and 2 (usage) stay permanent.
PREEMPTION_EXIT_CODE = 138
RESULT_NAME = "result.json"
HEARTBEAT_INTERVAL_S = 0.5
PARENT_PID_ENV = "TFDAG_PARENT_PID"


class WorkerSpec(BaseModel):
    """Everything a worker needs besides TF_CONFIG; written by the launcher (or a pod's init) as JSON."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    config: dict[str, Any]  # PipelineConfig.model_dump(mode="json")
    dataset_uri: str  # the manifest's dataset_uri
    plan: ShardPlan
    run_dir: str
    mlflow_run_id: str | None = None
    heartbeat_dir: str  # a local directory the supervisor watches

    def pipeline_config(self) -> PipelineConfig:
        return parse_config(self.config, source="the worker spec's config")


def load_spec(spec_uri: str) -> WorkerSpec:
    """Read a WorkerSpec JSON from a path or fsspec URI."""
    fs, path = storage.get_fs(spec_uri)
    with fs.open(path, "rb") as handle:
        return WorkerSpec.model_validate_json(handle.read())


def heartbeat_name(cluster: ClusterInfo) -> str:
    """The heartbeat file name of a task: `worker-1.json`, `chief-0.json`."""
    return f"{cluster.task_type}-{cluster.task_index}.json"


class Heartbeat:
    """Writes `<heartbeat_dir>/<task>.json` with step, time and examples, at most every `interval_s`.

    Written atomically (temp file + rename) so the supervisor never reads half a file.
    """

    def __init__(self, heartbeat_dir: str, cluster: ClusterInfo, interval_s: float = HEARTBEAT_INTERVAL_S):
        os.makedirs(heartbeat_dir, exist_ok=True)
        self.path = os.path.join(heartbeat_dir, heartbeat_name(cluster))
        self.task = cluster.name
        self.interval_s = interval_s
        self.examples = 0
        self._last_write = float("-inf")

    def beat(self, step: int, examples: int, *, force: bool = False) -> None:
        self.examples += examples
        now = time.monotonic()
        if not force and now - self._last_write < self.interval_s:
            return
        self._last_write = now
        payload = json.dumps({"task": self.task, "pid": os.getpid(), "step": int(step), "time": time.time(),
                              "examples": int(self.examples)})
        tmp = f"{self.path}.{os.getpid()}.tmp"
        with open(tmp, "w") as handle:
            handle.write(payload)
        os.replace(tmp, self.path)


def read_heartbeat(path: str) -> dict[str, Any] | None:
    """One heartbeat file's content, or None when it is missing or unreadable."""
    try:
        with open(path) as handle:
            return json.loads(handle.read())
    except (OSError, ValueError):
        return None


class WorkerHooks:
    """The training loop's hooks in a worker: heartbeats, fault injection and SIGTERM as a stop request."""

    def __init__(self, heartbeat: Heartbeat | None, injector: faults.FaultInjector | None):
        self.heartbeat = heartbeat
        self.injector = injector
        self.preempted = False

    def on_step_end(self, step: int, examples: int, loss: float) -> None:
        if self.heartbeat is not None:
            self.heartbeat.beat(step, examples, force=step == 1)
        if self.injector is not None:
            self.injector.on_step_end(step)

    def stop_requested(self) -> bool:
        return self.preempted

    def install_sigterm(self) -> None:
        """SIGTERM sets the stop request: the loop saves a coordinated checkpoint at the next step boundary."""

        def handle(signum, frame):
            if not self.preempted:
                print("tfdag worker | SIGTERM received: checkpointing at the next step boundary", flush=True)
            self.preempted = True

        signal.signal(signal.SIGTERM, handle)


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when the launcher that started it dies (no orphans after a crash)."""
    parent = os.environ.get(PARENT_PID_ENV)
    if not parent or not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:  # pragma: no cover - no libc: rely on the launcher's process-group kill
        return
    if os.getppid() != int(parent):  # the launcher died before prctl took effect
        os._exit(PREEMPTION_EXIT_CODE)


def _create_sink(config: PipelineConfig, cluster: ClusterInfo, run_id: str | None):
    from pipeline_lib.tracking import mlflow_run as tracking

    sink_type = getattr(tracking, "MlflowSink", None)
    if not cluster.is_chief or not run_id or sink_type is None or not config.tracking.enabled:
        return tracking.NullSink()
    return sink_type(run_id, config.mlflow_uri)


def _run_preflight(spec: WorkerSpec, config: PipelineConfig, cluster: ClusterInfo, data_hash: str) -> None:
    if not config.preflight.enabled:
        return
    try:
        from pipeline_lib.cluster.preflight import run_preflight
    except ImportError:
        logger.info("pipeline_lib.cluster.preflight is not available; skipping the cross-worker preflight")
        return
    run_preflight(spec.run_dir, cluster, config.config_hash(), data_hash, config.preflight.timeout_s,
                  storage_options=config.storage_options)


def _write_result(run_dir: str, result, storage_options: dict) -> None:
    fs, path = storage.get_fs(storage.join(run_dir, RESULT_NAME), storage_options)
    storage.write_bytes_atomic(fs, path, result.model_dump_json(indent=2).encode())


def is_server_task(config: PipelineConfig, cluster: ClusterInfo) -> bool:
    """ps and worker tasks of a parameter-server cluster serve; they do not run the training loop."""
    uses_ps = config.train.strategy == Strategy.PARAMETER_SERVER or (
        config.train.strategy == Strategy.AUTO and cluster.has_ps)
    return uses_ps and cluster.has_ps and cluster.task_type in ("ps", "worker")


def run_worker(spec: WorkerSpec, cluster: ClusterInfo | None = None) -> int:
    """Run one task of the cluster to completion and return its exit code (see the module docstring)."""
    cluster = cluster if cluster is not None else cluster_from_env()
    config = spec.pipeline_config()
    from pipeline_lib.data.manifest import load_manifest
    from pipeline_lib.training import strategy as strategies

    # Before any TensorFlow op: logical devices cannot be split once the runtime is up.
    strategies.configure_devices(config.train)
    manifest = load_manifest(spec.dataset_uri, config.storage_options)
    _run_preflight(spec, config, cluster, manifest.content_hash())
    from pipeline_lib.training import loop as training

    if is_server_task(config, cluster):
        # The server blocks inside C++; SIGTERM keeps its default action (exit 143, retryable).
        training.run_server(cluster)
        return 0
    injector = faults.injector_from_env(cluster.worker_index, spec.run_dir, storage_options=config.storage_options)
    if injector is not None:
        injector.install_save_hook()
    hooks = WorkerHooks(Heartbeat(spec.heartbeat_dir, cluster), injector)
    choice = strategies.create_strategy(config.train, cluster)
    # After the strategy: MultiWorkerMirrored's coordination service installs a C++ SIGTERM notifier
    # that would otherwise replace Python's handler.
    hooks.install_sigterm()
    sink = _create_sink(config, cluster, spec.mlflow_run_id)
    try:
        result = training.train(config, manifest, spec.plan, spec.run_dir, cluster=cluster, metrics_sink=sink,
                                hooks=hooks, strategy_choice=choice)
    except training.TrainingInterrupted as stop:
        print(f"tfdag worker | {cluster.name} preempted at step {stop.step}; checkpoint {stop.checkpoint_path}; "
              f"exiting with {PREEMPTION_EXIT_CODE} (retryable)", flush=True)
        return PREEMPTION_EXIT_CODE
    if hooks.heartbeat is not None:
        hooks.heartbeat.beat(result.final_step, 0, force=True)
    if cluster.is_chief:
        _write_result(spec.run_dir, result, config.storage_options)
    logger.info("%s finished at step %d", cluster.name, result.final_step)
    return 0


def worker_main(argv: Sequence[str] | None = None) -> int:
    """`tfdag worker --spec SPEC_URI`: the body of the CLI subcommand; returns the process exit code."""
    parser = argparse.ArgumentParser(prog="tfdag worker", description="Run one task of a tfdag training cluster "
                                     "(TF_CONFIG from the environment).")
    parser.add_argument("--spec", required=True, help="path or fsspec URI of the WorkerSpec JSON")
    args = parser.parse_args(argv)
    _die_with_parent()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        spec = load_spec(args.spec)
        return run_worker(spec)
    except Exception:  # every exception is reported the same way: traceback, exit 1
        traceback.print_exc(file=sys.stderr)
        sys.stderr.flush()
        return 1


def main() -> None:
    # os._exit: TensorFlow's gRPC and collective threads can hang interpreter shutdown after training is done.
    code = worker_main()
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


if __name__ == "__main__":
    main()
