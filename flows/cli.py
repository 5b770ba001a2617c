"""The `tfdag` command line: the whole pipeline, each stage alone, workers, cluster checks and the local stack."""

from __future__ import annotations

import argparse
import atexit
import json
import logging
import os
import sys
import threading

from flows.stage_commands import (
    cmd_convert,
    cmd_evaluate,
    cmd_plan,
    cmd_train,
    cmd_validate_data,
)

# Nothing from pipeline_lib at module level: importing it quiets TensorFlow unless TFDAG_VERBOSE is set, which
# main() sets for `-v` first. The exit codes are pipeline_lib.core.exit_codes' (the README lists them).

DESCRIPTION = """\
tfdag runs end-to-end TensorFlow training DAGs as Prefect flows:
TFRecord conversion -> shard planning -> cluster validation -> distributed training
-> checkpoint consolidation -> evaluation -> MLflow tracking.

  tfdag run examples/digits.yaml          the whole pipeline (a Prefect flow)
  tfdag run examples/digits.yaml --json   ... and print the summary as JSON on the last line
  tfdag run examples/digits.yaml --resume [RUN_NAME]   finish a failed or killed run (default: the latest)
  tfdag tune examples/digits_tune.yaml    tune: parallel, pruned, resumable trials; the best model gated
  tfdag convert|plan|validate|train|evaluate CONFIG   one stage alone, without Prefect
  tfdag validate-data CONFIG [--against latest|champion|RUN_ID]   check the data against a baseline run
  tfdag validate-cluster --strategy multi_worker_mirrored   check TF_CONFIG before training
  tfdag reproduce RUN_ID                  retrain a tracked run and prove its weights bit for bit
  tfdag predict MODEL INPUT OUTPUT        score a table of any size (models:/NAME@champion, CSV/Parquet/JSONL in)
  tfdag stack up [--ray N]                local Prefect + MLflow servers, work pool, worker, deployments
                                          (--ray N: and a local Ray cluster of N nodes)

exit codes: 0 success, 1 failure, 2 bad input (one line names the value and the fix),
            3 trained, not blessed (the evaluation gate or the model check refused it), 130 interrupted
"""


def cmd_run(args: argparse.Namespace) -> int:
    from pipeline_lib.serving import fresh_process

    try:
        return _run_pipeline(args)
    finally:
        fresh_process.discard_warm()  # the check's process `_load_run` started, when no check took it


def _run_pipeline(args: argparse.Namespace) -> int:
    from flows.flow_config import DEFAULT_CONFIG
    from pipeline_lib.core import startup
    from pipeline_lib.core.exit_codes import EXIT_NOT_BLESSED, EXIT_OK
    from pipeline_lib.launch.inputs import check_inputs

    if not hasattr(args, "loaded"):  # main() loads it before TensorFlow's import; a caller of cmd_run may not have
        _load_run(args)
    if isinstance(args.loaded, Exception):  # no such config, no such run, or a changed config: before Prefect starts
        raise args.loaded
    config, _ = args.loaded
    # The flow gets the file's path, not its content: a Prefect parameter is stored by the server, and a
    # config may carry storage options. Checking it here first rejects bad input before Prefect starts.
    with startup.imports():
        from pipeline_lib.core import native  # noqa: F401 - where the C loops did not build, the warning comes first
        check_inputs(config)
        from flows.pipeline import training_pipeline
        from flows.prefect_api import (
            api_from_profile,
            choose_prefect_api,
            heartbeats_only_when_set,
        )

    chosen = getattr(args, "prefect_api", None) or choose_prefect_api()  # main() chose it before Prefect's import
    print(f"tfdag | Prefect: {api_from_profile(chosen).describe()}", flush=True)

    _hide_user_error_tracebacks(args.verbose)
    from flows import console

    with console.open_console(live=console.is_terminal(args.verbose)) as show, heartbeats_only_when_set():
        summary = training_pipeline(args.config or DEFAULT_CONFIG, resume=args.resume)
        show(console.summary_event(summary))
    if args.json:
        print(summary.model_dump_json())
    return EXIT_OK if summary.blessed else EXIT_NOT_BLESSED


def _load_run(args: argparse.Namespace) -> None:
    """`tfdag run`, before TensorFlow's import: the config loaded and, resuming, the run to resume found, once, into
    `args.loaded` (the pair, or the error `_run_pipeline` raises). When the run will check its model, the check's fresh
    process starts now, so that its imports overlap this process's (the flow's `fresh_process.warmed` takes it)."""
    from flows.flow_config import load
    from pipeline_lib.serving import fresh_process
    from pipeline_lib.tracking.stage_record import model_check_due, resume_point

    try:
        config = load(args.config)
        earlier = resume_point(config, args.resume)[1] if args.resume else None
    except Exception as error:  # noqa: BLE001 - reported by _run_pipeline, through the CLI's handling of errors
        args.loaded = error
        return
    args.loaded = (config, earlier)
    if model_check_due(config, earlier):
        fresh_process.warm_up()  # the store not yet: the run may still have to create it (the flow's warm-up opens it)


def cmd_tune(args: argparse.Namespace) -> int:
    from flows.flow_config import load
    from pipeline_lib.config.tune_space import tune_of
    from pipeline_lib.core.exit_codes import EXIT_NOT_BLESSED, EXIT_OK
    from pipeline_lib.launch.inputs import check_inputs

    config = load(args.config)
    tune_of(config)  # refused in one line (exit 2) before Prefect starts
    check_inputs(config)  # the launcher, the model factory, TF_CONFIG and storage, before Prefect starts
    from flows.prefect_api import api_from_profile, heartbeats_only_when_set
    from pipeline_lib.core import startup

    with startup.imports():
        from flows.tune import tune_pipeline

    print(f"tfdag | Prefect: {api_from_profile(args.prefect_api).describe()}", flush=True)
    _hide_user_error_tracebacks(args.verbose)
    with heartbeats_only_when_set():
        summary = tune_pipeline(args.config)
    counts = ", ".join(f"{n} {state}" for state, n in summary.trials.items())
    best = (f"best trial {summary.best_trial.number}: {summary.metric}={summary.best_trial.value:.4f} "
            f"{json.dumps(summary.best_trial.params)}" if summary.best_trial else "no trial completed")
    print(f"tfdag | study {summary.study}: {counts} | {best}", flush=True)
    if summary.model is not None:
        from flows import console

        with console.open_console(live=False) as show:
            show(console.summary_event(summary.model))
    if args.json:
        print(summary.model_dump_json())
    return EXIT_OK if summary.blessed else EXIT_NOT_BLESSED


def cmd_validate(args: argparse.Namespace) -> int:
    from flows.flow_config import load
    from pipeline_lib.cluster.check import validate_cluster
    from pipeline_lib.core.exit_codes import EXIT_OK

    report = validate_cluster(load(args.config))
    print(report.to_markdown())
    return EXIT_OK


def cmd_validate_cluster(args: argparse.Namespace) -> int:
    from pipeline_lib.cluster import validate_command

    return validate_command.run_validate_cluster(
        tf_config=args.tf_config,
        strategy=args.strategy,
        peers=args.peers,
        run_dir=args.run_dir,
        timeout_s=args.timeout,
        out=sys.stdout,
    )


def cmd_reproduce(args: argparse.Namespace) -> int:
    from flows.flow_config import load
    from pipeline_lib.core.exit_codes import EXIT_FAILURE, EXIT_OK
    from pipeline_lib.reproduce.rerun import reproduce

    if args.tracking_uri:
        tracking_uri = args.tracking_uri
    elif args.config:
        tracking_uri = load(args.config).mlflow_uri
    else:
        tracking_uri = os.environ.get("MLFLOW_TRACKING_URI") or load(None).mlflow_uri
    outcome = reproduce(args.run_id, tracking_uri, tolerance=args.tolerance, work_dir=args.work_dir, log_fn=print)
    for line in outcome.report_lines():
        print(f"tfdag | {line}")
    return EXIT_OK if outcome.reproduced else EXIT_FAILURE


def cmd_predict(args: argparse.Namespace) -> int:
    from flows import predict_command

    return predict_command.cmd_predict(args)


def cmd_worker(args: argparse.Namespace) -> int:
    from pipeline_lib.launch import worker

    code = worker.worker_main(["--spec", args.spec])
    # TensorFlow's gRPC and collective threads can hang interpreter shutdown; leave at once, as
    # `python -m pipeline_lib.launch.worker` does.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def cmd_schema(args: argparse.Namespace) -> int:
    from pipeline_lib.config.json_schema import schema_text
    from pipeline_lib.core.exit_codes import EXIT_OK

    sys.stdout.write(schema_text())
    return EXIT_OK


def cmd_demo_data(args: argparse.Namespace) -> int:
    from pipeline_lib.core.exit_codes import EXIT_OK
    from pipeline_lib.data import demo as demo_data

    print(demo_data.write_digits_csv(args.uri))
    return EXIT_OK


def cmd_stack(args: argparse.Namespace) -> int:
    from flows import stack

    return stack.stack_command(args.action, root=args.root, out=sys.stdout, ray_nodes=args.ray)


class _UserErrorTracebackFilter(logging.Filter):
    """Keeps user errors, and outages tfdag names itself, to the CLI's one line on the console.

    Prefect logs a failed task's or flow's exception with its traceback; for an error caused by the input, or an
    outage whose message names the server and what to do (a TransientError), that is noise around the one line the
    CLI prints last. The records still reach the Prefect server through its API handler, which this filter is not
    attached to.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        from pipeline_lib.core.errors import TransientError, is_user_error

        error = record.exc_info[1] if record.exc_info else None
        if error is None or not (is_user_error(error) or isinstance(error, TransientError)):
            return True
        if record.name.startswith("prefect"):
            return False
        record.exc_info, record.exc_text = None, None
        return True


def _hide_user_error_tracebacks(verbose: bool) -> None:
    """Attach the filter to the console handlers Prefect configured (on import); `-v` keeps every traceback."""
    if verbose:
        return
    handlers = set(logging.getLogger().handlers) | set(logging.getLogger("prefect").handlers)
    for handler in handlers:
        if not any(isinstance(f, _UserErrorTracebackFilter) for f in handler.filters):
            handler.addFilter(_UserErrorTracebackFilter())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tfdag", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, fn, help_text: str, config: bool = True) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text)
        if config:
            p.add_argument("config", nargs="?", default=None,
                           help="pipeline YAML file (default: the bundled examples/digits.yaml)")
        p.set_defaults(fn=fn)
        return p

    p = add("run", cmd_run, "run the whole pipeline as the Prefect flow 'training-pipeline'")
    p.add_argument("--json", action="store_true", help="print the run summary as one JSON object on the last line")
    p.add_argument("--resume", nargs="?", const="latest", default=None, metavar="RUN_NAME",
                   help="finish a failed, killed or interrupted run of this config in place (default: the latest); "
                        "the stages it finished are not run again")
    p = add("tune", cmd_tune, "tune the config's tune: space as the Prefect flow 'tune-pipeline' (trials in parallel, "
            "pruned, resumable), then gate and register the best model", config=False)
    p.add_argument("config", help="pipeline YAML file with a tune: section (e.g. examples/digits_tune.yaml)")
    p.add_argument("--json", action="store_true", help="print the study summary as one JSON object on the last line")
    add("convert", cmd_convert, "convert the raw data to TFRecord shards with a manifest")
    p = add("plan", cmd_plan, "print the shard plan (FILE or DATA autosharding, files per worker, steps per epoch)")
    p.add_argument("--workers", type=int, default=None, help="plan for this many workers instead of train.workers")
    add("validate", cmd_validate, "check the strategy against this machine and TF_CONFIG; print the cluster report")
    p = add("validate-data", cmd_validate_data,
            "convert the data and check it against a baseline run's statistics: exit 0, or 2 with one line per anomaly")
    p.add_argument("--against", default=None,
                   help="latest (the last successful run of this pipeline), champion, or an MLflow run id "
                        "(default: validation.against)")
    add("train", cmd_train, "convert, plan and train (no Prefect, no MLflow); prints the TrainResult")
    p = add("evaluate", cmd_evaluate, "evaluate an exported .keras model on the eval split")
    p.add_argument("--model", required=True, help="path of an exported model.keras")

    p = add("validate-cluster", cmd_validate_cluster,
            "check TF_CONFIG (env or --tf-config) for STRATEGY; with --peers run the cross-worker preflight",
            config=False)
    p.add_argument("--tf-config", default=None, help="TF_CONFIG as a file path or inline JSON (default: $TF_CONFIG)")
    p.add_argument("--strategy", default="multi_worker_mirrored",
                   help="the strategy the cluster is for (default: multi_worker_mirrored)")
    p.add_argument("--peers", action="store_true", help="also run the cross-worker preflight against every peer")
    p.add_argument("--run-dir", default=None, help="fsspec URI shared by all tasks for the preflight files")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for every peer (default 60)")

    p = add("reproduce", cmd_reproduce,
            "retrain a tracked run from its MLflow record and compare the weights: exit 0 reproduced, 1 not",
            config=False)
    p.add_argument("run_id", help="the MLflow run id (from `tfdag run` or the MLflow UI)")
    p.add_argument("--tracking-uri", default=None,
                   help="the MLflow store (default: --config's, else $MLFLOW_TRACKING_URI, else the bundled config's)")
    p.add_argument("--config", default=None, help="a pipeline YAML whose MLflow store to read the run from")
    p.add_argument("--tolerance", type=float, default=None,
                   help="compare weights within this absolute bound instead of bit for bit (lets a "
                        "non-deterministic run through)")
    p.add_argument("--work-dir", default=None, help="where the rerun trains (default: <output_root>/reproduce)")

    from flows import init_command

    init_command.add_arguments(add("init", init_command.cmd_init, init_command.HELP, config=False))
    add("schema", cmd_schema, "print the config's JSON Schema (editors complete and check a YAML config with it)",
        config=False)

    from flows import predict_command

    predict_command.add_arguments(add("predict", cmd_predict, predict_command.HELP, config=False))

    p = add("worker", cmd_worker, "run one training task (reads TF_CONFIG); what a cluster pod runs", config=False)
    p.add_argument("--spec", required=True, help="path or URI of the worker spec JSON written by the launcher")

    p = add("demo-data", cmd_demo_data, "write scikit-learn's bundled digits as CSV to any fsspec URI", config=False)
    p.add_argument("uri", help="target URI, e.g. ./.tfdag/raw/digits.csv or s3://tfdag-demo/raw/digits.csv")

    p = add("stack", cmd_stack, "start/stop a local Prefect server, MLflow server, work pool and worker",
            config=False)
    p.add_argument("action", choices=["up", "down", "status"])
    p.add_argument("--root", default="./.tfdag", help="state directory (default ./.tfdag)")
    p.add_argument("--ray", type=int, default=0, metavar="N",
                   help="up: also start a local Ray cluster of N nodes on 127.0.0.2 (train.launcher: ray)")
    return parser


def _drop_routine_state_lines(record: logging.LogRecord) -> bool:
    """The console leaves out Prefect's "Finished in state Completed()" after each task (the Prefect UI keeps it):
    a stage that did not complete still shows."""
    return not (record.name.startswith("prefect.") and record.getMessage() == "Finished in state Completed()")


def _start_up(args: argparse.Namespace) -> None:
    """Before the command runs: loggers quieted, Prefect's API chosen, the model check's process started ahead,
    TensorFlow imported (its start-up lines held back)."""
    from pipeline_lib.core.quiet import quiet_python_loggers

    quiet_python_loggers()
    if args.command in ("run", "tune"):  # the commands that run a flow
        from flows.prefect_api import choose_prefect_api

        # Before anything imports Prefect: its settings are read at import.
        args.prefect_api = choose_prefect_api()
    if args.command == "run":
        _load_run(args)
    if args.command != "stack":  # every other command loads TensorFlow
        from pipeline_lib.core.quiet import import_tensorflow

        import_tensorflow()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # Prefect's anonymous telemetry is off: nothing leaves the machine.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    if args.verbose:
        os.environ["TFDAG_VERBOSE"] = "1"  # workers inherit it
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from pipeline_lib.core import startup
    from pipeline_lib.core.exit_codes import run_to_exit_code

    with startup.imports():
        _start_up(args)
    if not args.verbose:
        for handler in logging.getLogger().handlers:
            handler.addFilter(_drop_routine_state_lines)

    # Every error becomes one line and an exit code (core.exit_codes): a UserError exit 2, its traceback with -v.
    return run_to_exit_code(lambda: args.fn(args), lambda text: print(text, file=sys.stderr), prefix="tfdag: ",
                            verbose=args.verbose)


def entry() -> None:
    """The `tfdag` command: `main()`, then an exit without the interpreter's teardown.

    Once TensorFlow is loaded, Python's own finalization (modules, then TensorFlow's C++ statics) takes seconds
    after the work is done, a large share of a short command's wall time. What must happen at exit still does, in the
    interpreter's own order: `threading._shutdown` (thread pools told to stop, threads that are not daemons
    joined), the atexit handlers (Prefect's log and event drains, logging's flush), then the buffers are flushed
    and the process ends with main()'s exit code."""
    code = main()
    threading._shutdown()  # what Py_FinalizeEx calls first; a pool's workers wait for its signal to end
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    entry()
