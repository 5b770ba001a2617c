"""The worker entry point (`tfdag worker --spec SPEC_URI`): one task of a training cluster, local or in a pod.

A worker reads TF_CONFIG from the environment and a `WorkerSpec` JSON from a path or fsspec URI, splits
the CPU into logical devices before TensorFlow starts, runs the cross-worker preflight when the config enables
it, then either trains (the chief and the workers of a synchronous strategy, the chief/coordinator
under parameter_server) or serves (ps and worker tasks under parameter_server). It is the composition root of
a training process: it wires the metrics sink, heartbeats, SIGTERM handling, a tuning trial's pruner (its chief) and
(in tests only) fault injection into the training loop.

Exit codes:
    0: training finished (the chief wrote `<run_dir>/result.json`).
    1: a Python exception; the traceback is on stderr. Permanent: restarting will not help.
    USER_ERROR_EXIT_CODE (2): a UserError (bad input); one line on stderr starting with USER_ERROR_PREFIX names
        the value and the fix. Permanent.
    PREEMPTION_EXIT_CODE (138): SIGTERM (a preemption notice) was received; a checkpoint agreed by every
        worker was saved first. Retryable: restart the group and it resumes from that checkpoint.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Protocol

from pipeline_lib.core.quiet import import_tensorflow

import_tensorflow()  # first, its start-up lines held back unless TFDAG_VERBOSE=1

from pipeline_lib.cluster.info import ClusterInfo, cluster_from_env
from pipeline_lib.cluster.preflight import run_preflight
from pipeline_lib.config import PipelineConfig
from pipeline_lib.core import storage
from pipeline_lib.core.exit_codes import run_to_exit_code
from pipeline_lib.core.quiet import is_verbose, quiet_python_loggers
from pipeline_lib.data.manifest import Manifest, load_manifest
from pipeline_lib.launch.heartbeat import EvalOnHeartbeat, Heartbeat
from pipeline_lib.launch.prometheus import TaskMetrics
from pipeline_lib.launch.spec import (
    EXAMPLE_IDS_ENV,
    FAULT_ENV,
    PARENT_PID_ENV,
    PREEMPTION_EXIT_CODE,
    RESULT_FAULT_POINT,
    RESULT_NAME,
    USER_ERROR_PREFIX,
    WorkerSpec,
    load_spec,
)
from pipeline_lib.tracking.sinks import create_sink, system_metrics
from pipeline_lib.training import loop as training
from pipeline_lib.training import strategy as strategies
from pipeline_lib.training.early_stopping import StopRule
from pipeline_lib.training.errors import TrainingInterrupted
from pipeline_lib.training.hooks import Execution, Phase, TrainHooks
from pipeline_lib.training.profiling import start_profiler_server
from pipeline_lib.training.results import TrainResult

logger = logging.getLogger(__name__)


class FaultHooks(Protocol):
    """What the test-only fault injector (`pipeline_lib.testing.faults.FaultInjector`) is called with."""

    def on_step_end(self, step: int) -> None: ...

    def on_phase(self, phase: str, step: int) -> None: ...


class InputHooks(Protocol):
    """What the test-only example-id recorder (`pipeline_lib.testing.example_ids.ExampleIdRecorder`) provides."""

    def input_batches(self, batches, input_pipeline_id: int, start_step: int): ...


_KEPT_UNTIL_EXIT: list = []  # what a worker process must not destroy before its exit (`WorkerHooks.input_done`)


class WorkerHooks(TrainHooks):
    """The training loop's hooks in a worker: heartbeats with the phase, optional faults and example-id records
    (tests), SIGTERM as a stop."""

    def __init__(self, heartbeat: Heartbeat | None, faults: FaultHooks | None = None,
                 metrics: TaskMetrics | None = None, stop: threading.Event | None = None,
                 inputs: InputHooks | None = None):
        self.heartbeat = heartbeat
        self.faults = faults
        self.inputs = inputs
        self.metrics = metrics
        self.preempted = False
        self.stop = stop  # in-process training: the launcher's stop request, in place of SIGTERM

    def input_done(self, iterator) -> None:
        """A worker process keeps its input iterator until it exits (`main`'s `os._exit`, which never destroys it):
        destroying it waits for its tf.data threads, and one of them could take seconds to end (gdb: the main
        thread in `~RootDataset::Iterator`; by the timing, the autotuner's loop, whose wait doubles up to 60 s as
        training runs), so a worker outlived its chief by 8-10 s in a third of 1,000-step Ray runs and by over 30 s
        in a 3,000-step one. Training in the caller's process (`stop` given) releases it, as the default does."""
        if self.stop is None:
            _KEPT_UNTIL_EXIT.append(iterator)

    def on_execution(self, execution: Execution) -> None:
        if self.metrics is not None:
            self.metrics.on_execution(execution)

    def on_checkpoint(self, step: int, seconds: float) -> None:
        if self.metrics is not None:
            self.metrics.on_checkpoint(seconds)

    def on_restored(self, step: int) -> None:
        if self.heartbeat is not None:
            self.heartbeat.start_step = step
            self.heartbeat.beat(step, 0, phase=Phase.STARTING, force=True)
        if self.faults is not None:
            self.faults.on_phase(Phase.STARTING.value, step)

    def on_step_end(self, step: int, examples: int, loss: float) -> None:
        if self.heartbeat is not None:
            self.heartbeat.beat(step, examples, force=step == 1, loss=loss)
        if self.faults is not None:
            self.faults.on_step_end(step)

    def on_phase(self, phase: Phase, step: int) -> None:
        if self.heartbeat is not None:
            self.heartbeat.beat(step, 0, phase=phase)
        if self.faults is not None:
            self.faults.on_phase(phase.value, step)

    def before_result(self, step: int) -> None:
        """Training returned (the final checkpoint is saved) and the result is not written yet: a fault point."""
        if self.heartbeat is not None:
            self.heartbeat.beat(step, 0, phase=Phase.FINISHING, force=True)
        if self.faults is not None:
            self.faults.on_phase(RESULT_FAULT_POINT, step)

    def stop_requested(self) -> bool:
        return self.preempted or (self.stop is not None and self.stop.is_set())

    def input_batches(self, batches, input_pipeline_id: int, start_step: int):
        if self.inputs is None:
            return batches
        return self.inputs.input_batches(batches, input_pipeline_id, start_step)

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
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:  # pragma: no cover - no libc: rely on the launcher's process-group kill
        return
    if os.getppid() != int(parent):  # the launcher died before prctl took effect
        os._exit(PREEMPTION_EXIT_CODE)


def _create_fault_hooks(spec: WorkerSpec, config: PipelineConfig, cluster: ClusterInfo) -> FaultHooks | None:
    """Test-only: the fault injector when TFDAG_FAULT names a fault for this worker, else None.

    Raises:
        FaultSpecError: when TFDAG_FAULT is set but malformed.
    """
    if not os.environ.get(FAULT_ENV):
        return None
    # Test support is loaded only when a test asks for a fault: production runs never import it.
    from pipeline_lib.testing import faults

    injector = faults.injector_from_env(cluster.worker_index, spec.run_dir, storage_options=config.storage_options)
    if injector is None:
        return None
    injector.install_save_hook()
    return injector


def _create_input_hooks(manifest: Manifest, cluster: ClusterInfo) -> InputHooks | None:
    """Test-only: the example-id recorder when TFDAG_TEST_EXAMPLE_IDS names a directory, else None."""
    directory = os.environ.get(EXAMPLE_IDS_ENV)
    if not directory:
        return None
    # Test support is loaded only when a test asks for the record: production runs never import it.
    from pipeline_lib.testing.example_ids import ExampleIdRecorder

    # Under parameter_server the training workers are the `worker` job (the chief coordinates).
    num_workers = len(cluster.cluster["worker"]) if cluster.has_ps else cluster.num_workers
    return ExampleIdRecorder(directory, manifest.feature_schema, num_workers)


def _start_metrics(spec: WorkerSpec, config: PipelineConfig, cluster: ClusterInfo,
                   heartbeat: Heartbeat | None) -> TaskMetrics | None:
    """This task's Prometheus endpoint (`observability.prometheus_port`), on its own cluster address's host, told
    to the supervisor in its heartbeat (which reaches it on any launcher); None when off."""
    port = config.observability.prometheus_port
    if port is None:
        return None
    addresses = cluster.cluster.get(cluster.task_type, ())
    # A one-process run has no cluster spec: it serves on loopback.
    host = (addresses[cluster.task_index].rsplit(":", 1)[0].strip("[]") if cluster.task_index < len(addresses)
            else "127.0.0.1")
    run = os.path.basename(spec.run_dir.rstrip("/"))
    metrics = TaskMetrics(run, cluster.task_type, cluster.task_index, host, port)
    if heartbeat is not None:
        heartbeat.metrics = metrics.endpoint()
    logger.info("%s: Prometheus metrics on http://%s/metrics", cluster.name, metrics.target)
    return metrics


def _create_pruning(config: PipelineConfig, cluster: ClusterInfo) -> StopRule | None:
    """The chief of a tuning trial (`tune_trial` set): its pruner, reporting to the trial's study; else None. Only
    then is the tuning package (and Optuna) imported: other workers and every other run never load it."""
    if config.tune_trial is None or not cluster.is_chief:
        return None
    from pipeline_lib.tuning.pruning import TrialPruning

    return TrialPruning.open(config)


def _write_result(run_dir: str, result: TrainResult, storage_options: dict) -> None:
    fs, path = storage.get_fs(storage.join(run_dir, RESULT_NAME), storage_options)
    storage.write_bytes_atomic(fs, path, result.model_dump_json(indent=2).encode())


def is_server_task(config: PipelineConfig, cluster: ClusterInfo) -> bool:
    """ps and worker tasks of a parameter-server cluster serve; they do not run the training loop."""
    return config.train.uses_parameter_server(cluster.has_ps) and cluster.has_ps and cluster.task_type in ("ps", "worker")


def run_worker(spec: WorkerSpec, cluster: ClusterInfo | None = None, *, config: PipelineConfig | None = None,
               stop: threading.Event | None = None) -> int:
    """Run one task of the cluster to completion and return its exit code (see the module docstring).

    In a worker process `cluster` comes from TF_CONFIG and `config` from the spec. Training in the caller's
    own process (`train.isolation: none`, `launch.in_process`) passes both, with `stop` for the launcher's
    stop request: no SIGTERM handler (Python allows one only on the main thread) and no fault injection.
    """
    in_process = stop is not None
    cluster = cluster if cluster is not None else cluster_from_env()
    config = config if config is not None else spec.pipeline_config()
    # Before any TensorFlow op: logical devices cannot be split once the runtime is up.
    strategies.configure_devices(config.train)
    # STARTING from here to the first step: the watchdog gives it hang_timeout_s plus the startup allowance.
    heartbeat = None if is_server_task(config, cluster) else Heartbeat(spec.heartbeat_dir, cluster)
    if heartbeat is not None:
        heartbeat.beat(0, 0, force=True)
    manifest = load_manifest(spec.dataset_uri, config.storage_options)
    if config.preflight.enabled:
        run_preflight(spec.run_dir, cluster, config.config_hash(), manifest.content_hash(), config.preflight.timeout_s,
                      storage_options=config.storage_options)
    if heartbeat is None:
        # The server blocks inside C++; SIGTERM keeps its default action (exit 143, retryable).
        training.run_server(cluster)
        return 0
    metrics = _start_metrics(spec, config, cluster, heartbeat)
    if config.observability.profiler_port is not None:
        # One port per task, in cluster order (chief, workers, parameter servers) from profiler_port up.
        order = [(t, i) for t in ("chief", "worker", "ps") for i in range(len(cluster.cluster.get(t, ())))]
        offset = order.index((cluster.task_type, cluster.task_index)) if order else 0
        start_profiler_server(config.observability.profiler_port + offset)
    faults = None if in_process else _create_fault_hooks(spec, config, cluster)
    inputs = None if in_process else _create_input_hooks(manifest, cluster)
    hooks = WorkerHooks(heartbeat, faults, metrics, stop=stop, inputs=inputs)
    choice = strategies.create_strategy(config.train, cluster)
    if not in_process:
        # After the strategy: MultiWorkerMirrored's coordination service installs a C++ SIGTERM notifier
        # that would otherwise replace Python's handler.
        hooks.install_sigterm()
    sink = create_sink(spec.mlflow_run_id if config.tracking.enabled else None, config.mlflow_uri,
                       is_chief=cluster.is_chief)
    sink = EvalOnHeartbeat(sink, heartbeat)
    run_id = spec.mlflow_run_id if config.tracking.enabled else None
    pruning = _create_pruning(config, cluster)
    try:
        with system_metrics(run_id, config.mlflow_uri, is_chief=cluster.is_chief):
            result = training.train(config, manifest, spec.plan, spec.run_dir, cluster=cluster, metrics_sink=sink,
                                    hooks=hooks, strategy_choice=choice, stop_rule=pruning)
    except TrainingInterrupted as interrupted:
        print(f"tfdag worker | {cluster.name} preempted at step {interrupted.step}; checkpoint "
              f"{interrupted.checkpoint_path}; "
              f"exiting with {PREEMPTION_EXIT_CODE} (retryable)", flush=True)
        return PREEMPTION_EXIT_CODE
    hooks.before_result(result.final_step)
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
    quiet_python_loggers()
    # What the imports made, out of the garbage collector's reach before training: each full collection walked
    # those ~400k objects again (0.25 s of CPU). A worker forked from the fork server inherits them frozen already;
    # one the Ray launcher starts in a fresh interpreter freezes them here.
    gc.freeze()
    return exit_code(lambda: run_worker(load_spec(args.spec)), _to_stderr)


def _to_stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def exit_code(body: Callable[[], int], report: Callable[[str], None]) -> int:
    """`body()`'s exit code, or the exit code of the exception it raised, told to `report` by the one-line rule
    (`core.exit_codes`; see the module docstring): a UserError as one USER_ERROR_PREFIX line naming the value and
    the fix, any other exception with its traceback (the launcher shows the tail)."""
    return run_to_exit_code(body, report, prefix="tfdag worker: ", user_error_prefix=USER_ERROR_PREFIX,
                            verbose=is_verbose(), failure_traceback=True)


def main() -> None:
    # os._exit: TensorFlow's gRPC and collective threads can hang interpreter shutdown after training is done.
    code = worker_main()
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


if __name__ == "__main__":
    main()
