"""Orchestration on the demo itself: `tfdag run examples/digits.yaml` (preflight on, as shipped) against a running
Prefect server vs `train()` on the same config in a warm process.

- value: the whole demo as a user runs it, a fresh `tfdag run` process (`python -m flows.cli run ... --json`) with
  PREFECT_API_URL pointing at a Prefect server started here on 127.0.0.1 (as `tfdag stack up` leaves one):
  imports, checks, preflight, conversion reuse, validation, planning, an MLflow run, training (in the train task's own
  process: the demo sets train.isolation: none), consolidation and export, evaluation, registration;
- baseline: `pipeline_lib.training.loop.train(config, manifest, plan, run_dir)` called in this process, where
  TensorFlow is loaded and the data converted already.
One warm-up run of the demo first (it writes the digits CSV, converts it, creates the MLflow database and the
registered model, as every run but a machine's first finds them), then, for `repeats` rounds: direct train(), the
demo, and TensorFlow's import in a fresh process (what every `tfdag run` pays first). Two budgets: the demo's wall
time (≤ 12 s) and its fixed cost, demo minus direct train() of the same round, of at most TensorFlow's import
(the median of the same run's) plus 3 s. Where the demo's time goes is printed from its task runs on the server.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from bench import budget, report

DEMO_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "digits.yaml")


def _run_demo(project: str, api_url: str) -> tuple[float, dict, float]:
    """(wall seconds, the --json summary, the Unix time it started) of one `tfdag run examples/digits.yaml`."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PREFECT_API_URL=api_url, TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")]))
    started = time.time()
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "flows.cli", "run", DEMO_CONFIG, "--json"], cwd=project, env=env,
                          capture_output=True, text=True, timeout=900, check=False)
    seconds = time.perf_counter() - start
    if done.returncode not in (0, 3):  # 3: trained, not blessed
        raise RuntimeError(f"tfdag run exited {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return seconds, json.loads(done.stdout.strip().splitlines()[-1]), started


def _where_time_went(started: float, total_s: float) -> str:
    """The last flow run's breakdown: process start to flow start, each task run, flow end to process exit."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.client.schemas.sorting import FlowRunSort

    with get_client(sync_client=True) as client:
        (flow_run,) = client.read_flow_runs(sort=FlowRunSort.START_TIME_DESC, limit=1)
        tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run.id])))
    tasks = sorted((t for t in tasks if t.start_time and t.end_time), key=lambda t: t.start_time)
    before = flow_run.start_time.timestamp() - started
    flow_s = (flow_run.end_time - flow_run.start_time).total_seconds() if flow_run.end_time else float("nan")
    parts = [f"{t.name} {(t.end_time - t.start_time).total_seconds():.1f}" for t in tasks]
    return (f"process start, imports and checks until the flow run starts {before:.1f}s | flow run {flow_s:.1f}s: "
            + ", ".join(parts) + f" | after the flow, to exit {total_s - before - flow_s:.1f}s")


WALL_BUDGET_S = 12.0
FIXED_BEYOND_IMPORT_S = 3.0  # the fixed cost's budget: TensorFlow's import plus this
_IMPORT_TENSORFLOW = "from pipeline_lib.core.quiet import import_tensorflow; import_tensorflow()"


def _tensorflow_import_s() -> float:
    """Seconds a fresh interpreter takes to start and import TensorFlow (as `tfdag` does: its start-up lines held)."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")]))
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", _IMPORT_TENSORFLOW], env=env, check=True, timeout=300)
    return time.perf_counter() - start


def _timed(function, *args) -> tuple[float, object]:
    start = time.perf_counter()
    result = function(*args)
    return time.perf_counter() - start, result


def run(rows: int = 0, width: int = 0, quick: bool = False, repeats: int = 5) -> list[dict]:
    from pathlib import Path

    from flows import stack
    from pipeline_lib.config import load_config
    from pipeline_lib.core import net, runs
    from pipeline_lib.data.convert import convert
    from pipeline_lib.launch.spec import RESULT_NAME
    from pipeline_lib.planning import sharding
    from pipeline_lib.training import loop as training
    from pipeline_lib.training import strategy
    from pipeline_lib.training.results import TrainResult

    repeats = 1 if quick else repeats
    with tempfile.TemporaryDirectory() as project:
        server_s, server = _timed(stack.start_prefect_server, Path(project) / "prefect-server", net.free_port())
        api_url = server.url + "/api"
        previous_url = os.environ.get("PREFECT_API_URL")
        os.environ["PREFECT_API_URL"] = api_url  # for the breakdown's client, before Prefect is imported
        try:
            warm_s, _, _ = _run_demo(project, api_url)
            config = load_config(DEMO_CONFIG)
            # The config's paths (./.tfdag/...) and the manifest's are relative: the direct runs see them from
            # the project directory, as `tfdag run` does.
            with contextlib.chdir(project):
                manifest = convert(config.data, config.output_root)  # the warm-up's conversion, reused

            def direct(index: int) -> float:
                plan = sharding.plan_shards(
                    manifest, num_workers=1, replicas_per_worker=strategy.replicas_per_worker(config.train),
                    per_replica_batch_size=config.train.per_replica_batch_size, epochs=config.train.epochs,
                    steps=config.train.steps)
                with contextlib.chdir(project):
                    seconds, _ = _timed(training.train, config, manifest, plan,
                                        runs.run_dir_for(config.output_root, f"direct-{index}"))
                return seconds

            direct_s: list[float] = []
            demo_s: list[float] = []
            inside_s: list[float] = []
            import_s: list[float] = []
            for index in range(repeats):
                direct_s.append(direct(index))
                seconds, summary, started = _run_demo(project, api_url)
                result = TrainResult.model_validate_json(Path(project, summary["run_dir"], RESULT_NAME).read_text())
                demo_s.append(seconds)
                inside_s.append(result.wall_s)
                import_s.append(_tensorflow_import_s())
                print(f"  round {index + 1}: direct train() {direct_s[-1]:.1f}s | TensorFlow's import in a fresh "
                      f"process {import_s[-1]:.1f}s | tfdag run {seconds:.1f}s, its "
                      f"worker's train() {result.wall_s:.1f}s; {_where_time_went(started, seconds)}", flush=True)
        finally:
            if previous_url is None:
                os.environ.pop("PREFECT_API_URL", None)
            else:
                os.environ["PREFECT_API_URL"] = previous_url
            stack.stop_process(server)
    fixed = [demo - direct for demo, direct in zip(demo_s, direct_s)]
    fixed_budget = statistics.median(import_s) + FIXED_BEYOND_IMPORT_S
    print(f"orchestration: tfdag run examples/digits.yaml {statistics.median(demo_s):.1f}s (median of {repeats}; "
          f"warm-up {warm_s:.1f}s) | train() in a warm process {statistics.median(direct_s):.1f}s | fixed cost "
          f"{statistics.median(fixed):.1f}s | the worker's train() inside the demo {statistics.median(inside_s):.1f}s | "
          f"TensorFlow's import in a fresh process {statistics.median(import_s):.1f}s")
    print(f"  a Prefect server took {server_s:.1f}s to start (an ephemeral one adds that to every `tfdag run`)")
    return [
        report("TensorFlow's import in a fresh process (s)", import_s, unit="s",
               bound="loading TensorFlow's shared libraries and Python modules; the fixed cost's budget is this plus "
                     f"{FIXED_BEYOND_IMPORT_S:g} s."),
        budget("tfdag run examples/digits.yaml, fixed cost beyond train() in a warm process (s)", fixed, fixed_budget,
               bound="the fresh process's imports (TensorFlow's is the budget's first part), the first use of the "
                     "training step (AutoGraph, tracing), the Prefect flow and task runs, the MLflow run, export, "
                     "evaluation, the model check and registration, which train() in a warm process skips."),
        budget("tfdag run examples/digits.yaml wall time against a running Prefect server (s)", demo_s, WALL_BUDGET_S,
               bound="one Python process importing TensorFlow, Prefect and MLflow before the flow "
                     "starts, then training and the stages around it."),
    ]
