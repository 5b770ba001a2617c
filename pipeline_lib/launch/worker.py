"""The worker entry point (`tfdag worker --spec SPEC_URI`): one task of a training cluster, local or in a pod.

A worker reads TF_CONFIG from the environment and a `WorkerSpec` JSON from a path or fsspec URI, splits
the CPU into logical devices before TensorFlow starts, runs the cross-worker preflight when the config enables
it, then either trains (the chief and the workers of a synchronous strategy, the chief/coordinator
under parameter_server) or serves (ps and worker tasks under parameter_server). It is the composition root of
a training process: it wires the metrics sink, heartbeats, SIGTERM handling and a tuning trial's pruner (its chief)
into the training loop.

Test support enters here and nowhere else: when a test sets one of `TEST_SUPPORT_VARIABLES`, `worker_main` loads
`pipeline_lib.testing.worker_support`, which adds its faults, example-id records and faked preflight skew through
the public `WorkerAdditions` (more `TrainHooks`, a before-result callback, a preflight fingerprint transform).

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
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence

from pipeline_lib.core.quiet import import_tensorflow

import_tensorflow()  # first, its start-up lines held back unless TFDAG_VERBOSE=1

from pipeline_lib.cluster.info import ClusterInfo, cluster_from_env
from pipeline_lib.cluster.preflight import run_preflight
from pipeline_lib.config import PipelineConfig
from pipeline_lib.core import startup, storage
from pipeline_lib.core.exit_codes import run_to_exit_code
from pipeline_lib.core.quiet import is_verbose, quiet_python_loggers
from pipeline_lib.data.manifest import load_manifest
from pipeline_lib.launch.additions import (  # noqa: F401 - NO_ADDITIONS and is_server_task re-exported
    NO_ADDITIONS,
    AdditionsFn,
    WorkerAdditions,
    is_server_task,
)
from pipeline_lib.launch.heartbeat import EvalOnHeartbeat, Heartbeat
from pipeline_lib.launch.prometheus import TaskMetrics
from pipeline_lib.launch.spec import (
    PARENT_PID_ENV,
    PREEMPTION_EXIT_CODE,
    RESULT_NAME,
    USER_ERROR_PREFIX,
    WorkerSpec,
    load_spec,
)
from pipeline_lib.tracking.tracker import open_tracker
from pipeline_lib.training import loop as training
from pipeline_lib.training import strategy as strategies
from pipeline_lib.training.early_stopping import StopRule
from pipeline_lib.training.errors import TrainingInterrupted
from pipeline_lib.training.hooks import Execution, Phase, TrainHooks
from pipeline_lib.training.profiling import start_profiler_server
from pipeline_lib.training.results import TrainResult

logger = logging.getLogger(__name__)


# The variables that ask the worker entry for test support (`pipeline_lib.testing.worker_support` reads them and
# says what each does). This entry is the one production module that names them: with none set, a worker never
# imports pipeline_lib.testing.
TEST_SUPPORT_VARIABLES = ("TFDAG_FAULT", "TFDAG_TEST_EXAMPLE_IDS", "TFDAG_PREFLIGHT_OVERRIDE")


_KEPT_UNTIL_EXIT: list = []  # what a worker process must not destroy before its exit (`WorkerHooks.input_done`)


class WorkerHooks(TrainHooks):
    """The training loop's hooks in a worker: heartbeats with the phase, task metrics, SIGTERM as a stop, then the
    `extra` hooks a caller added (`WorkerAdditions.hooks`), in order."""

    def __init__(self, heartbeat: Heartbeat | None, metrics: TaskMetrics | None = None,
                 stop: threading.Event | None = None, extra: Sequence[TrainHooks] = (),
                 before_result: Sequence[Callable[[int], None]] = ()):
        self.heartbeat = heartbeat
        self.extra = tuple(extra)
        self.before_result_fns = tuple(before_result)
        self.metrics = metrics
        self.preempted = False
        self.stop = stop  # in-process training: the launcher's stop request, in place of SIGTERM

    def input_done(self, iterator) -> None:
        """A worker process keeps its input iterator until it exits (`main`'s `os._exit`, which never destroys it):
        destroying it waits for its tf.data threads, and one of them could take seconds to end (gdb: the main
        thread in `~RootDataset::Iterator`; by the timing, the autotuner's loop, whose wait doubles up to 60 s as
        training runs), so a worker could outlive its chief by seconds, more the longer it trained. Training in the
        caller's process (`stop` given) releases it, as the default does."""
        if self.stop is None:
            _KEPT_UNTIL_EXIT.append(iterator)
        for hook in self.extra:
            hook.input_done(iterator)

    def on_execution(self, execution: Execution) -> None:
        if self.metrics is not None:
            self.metrics.on_execution(execution)
        for hook in self.extra:
            hook.on_execution(execution)

    def on_checkpoint(self, step: int, seconds: float) -> None:
        if self.metrics is not None:
            self.metrics.on_checkpoint(seconds)
        for hook in self.extra:
            hook.on_checkpoint(step, seconds)

    def on_restored(self, step: int) -> None:
        if self.heartbeat is not None:
            self.heartbeat.start_step = step
            self.heartbeat.beat(step, 0, phase=Phase.STARTING, force=True)
        for hook in self.extra:
            hook.on_restored(step)

    def on_step_end(self, step: int, examples: int, loss: float) -> None:
        if self.heartbeat is not None:
            self.heartbeat.beat(step, examples, force=step == 1, loss=loss)
        for hook in self.extra:
            hook.on_step_end(step, examples, loss)

    def on_phase(self, phase: Phase, step: int) -> None:
        if self.heartbeat is not None:
            self.heartbeat.beat(step, 0, phase=phase)
        for hook in self.extra:
            hook.on_phase(phase, step)

    def before_result(self, step: int) -> None:
        """Training returned (the final checkpoint is saved) and the result is not written yet."""
        if self.heartbeat is not None:
            self.heartbeat.beat(step, 0, phase=Phase.FINISHING, force=True)
        for fn in self.before_result_fns:
            fn(step)

    def stop_requested(self) -> bool:
        return (self.preempted or (self.stop is not None and self.stop.is_set())
                or any(hook.stop_requested() for hook in self.extra))

    def input_batches(self, batches, input_pipeline_id: int, start_step: int):
        for hook in self.extra:
            batches = hook.input_batches(batches, input_pipeline_id, start_step)
        return batches

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


def _load_test_support() -> AdditionsFn | None:
    """Test-only: test support's additions when a test set one of TEST_SUPPORT_VARIABLES, else None (and nothing of
    pipeline_lib.testing is imported)."""
    if not any(os.environ.get(name, "").strip() for name in TEST_SUPPORT_VARIABLES):
        return None
    from pipeline_lib.testing import worker_support

    return worker_support.additions_from_env


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


def run_worker(spec: WorkerSpec, cluster: ClusterInfo | None = None, *, config: PipelineConfig | None = None,
               stop: threading.Event | None = None, additions_fn: AdditionsFn | None = None) -> int:
    """Run one task of the cluster to completion and return its exit code (see the module docstring).

    In a worker process `cluster` comes from TF_CONFIG and `config` from the spec. Training in the caller's
    own process (`train.isolation: none`, `launch.in_process`) passes both, with `stop` for the launcher's
    stop request: no SIGTERM handler (Python allows one only on the main thread). `additions_fn` builds what a
    caller adds to the task (`WorkerAdditions`; the worker entry's test support), once the manifest is loaded.
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
    additions = additions_fn(spec, config, cluster, manifest) if additions_fn is not None else NO_ADDITIONS
    if config.preflight.enabled:
        run_preflight(spec.run_dir, cluster, config.config_hash(), manifest.content_hash(), config.preflight.timeout_s,
                      storage_options=config.storage_options, fingerprint_fn=additions.fingerprint_fn)
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
    hooks = WorkerHooks(heartbeat, metrics, stop=stop, extra=additions.hooks, before_result=additions.before_result)
    choice = strategies.create_strategy(config.train, cluster)
    if not in_process:
        # After the strategy: MultiWorkerMirrored's coordination service installs a C++ SIGTERM notifier
        # that would otherwise replace Python's handler.
        hooks.install_sigterm()
    run_id = spec.mlflow_run_id if config.tracking.enabled else None
    tracker = open_tracker(config)
    sink = EvalOnHeartbeat(tracker.metrics_sink(run_id, is_chief=cluster.is_chief), heartbeat)
    pruning = _create_pruning(config, cluster)
    try:
        with tracker.system_metrics(run_id, is_chief=cluster.is_chief):
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
    # What the imports made, out of the garbage collector's reach before training: otherwise each full collection
    # walks those hundreds of thousands of objects again. A worker forked from the fork server inherits them frozen
    # already; one the Ray launcher starts in a fresh interpreter freezes them here.
    startup.settle()
    return exit_code(lambda: run_worker(load_spec(args.spec), additions_fn=_load_test_support()), _to_stderr)


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
