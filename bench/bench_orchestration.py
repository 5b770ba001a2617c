"""Orchestration overhead: the whole `training-pipeline` flow (Prefect + MLflow) vs calling `train` directly.

Both run the same config on the bundled digits (conversion done once beforehand and reused by both):
- baseline: `pipeline_lib.training.loop.train(config, manifest, plan, run_dir)` called in this process;
- value: `flows.pipeline.training_pipeline(config)` against a running Prefect server (started here on 127.0.0.1,
  as a deployment's flow runs see one): the storage check, conversion reuse, validation, planning, an MLflow run
  with per-step metrics, training in a supervised worker process (which imports TensorFlow itself),
  consolidation and export, evaluation, model registration.
One short warm-up of each first (the MLflow database and registered model exist after it, as they do for every
retraining but the first), then direct, flow, flow, direct: the mean of each, so that a machine that speeds up
or slows down over the minutes of the run weighs on both alike. The ratio is direct / flow wall time (≥ 0.909
means the flow is at most 10 % slower); the fixed overhead in seconds is printed, and so is the start of the
Prefect server, which an ephemeral server (`tfdag run` with no PREFECT_API_URL) pays once per process.
The training is sized by `train.steps` to take about 3 minutes (`--quick`: ~20 s, one run of each).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time

from bench import case

FULL_STEPS = 150000
QUICK_STEPS = 800


def _config(root: str, steps: int):
    from pipeline_lib.config import parse_config
    from pipeline_lib.data import demo as demo_data

    source = os.path.join(root, "raw", "digits.csv")
    demo_data.ensure_digits_csv(source)
    return parse_config({
        "name": "bench-orchestration",
        "data": {"source": source, "label": "target", "target_shard_mb": 0.25},
        "output_root": os.path.join(root, "out"),
        "model": {"factory": "mlp", "params": {"hidden_units": [256, 128]}},
        "train": {"strategy": "default", "per_replica_batch_size": 32, "steps": steps,
                  "checkpoint_every_steps": max(steps // 4, 1), "log_every_steps": 100, "shuffle": True},
        "evaluation": {"gate": {"threshold": None}},
        "tracking": {"experiment": "bench-orchestration", "registered_model": "bench-orchestration"},
        "preflight": {"enabled": False},
    })


@contextlib.contextmanager
def _logs_sent_before_exit():
    """Send the flow runs' queued logs while the server is up (at interpreter exit it would be gone)."""
    try:
        yield
    finally:
        from prefect.logging.handlers import APILogWorker

        APILogWorker.drain_all(timeout=5)


def _task_times() -> str:
    """Where the last flow run's time went: each task run's seconds, in start order, read from the server."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.client.schemas.sorting import FlowRunSort

    with get_client(sync_client=True) as client:
        (flow_run,) = client.read_flow_runs(sort=FlowRunSort.START_TIME_DESC, limit=1)
        tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run.id])))
    tasks = sorted((t for t in tasks if t.start_time and t.end_time), key=lambda t: t.start_time)
    parts = [f"{t.name} {(t.end_time - t.start_time).total_seconds():.1f}" for t in tasks]
    total = (flow_run.end_time - flow_run.start_time).total_seconds() if flow_run.end_time else float("nan")
    return f"flow run {total:.1f}s on the server: " + ", ".join(parts)


def _timed(function, *args) -> tuple[float, object]:
    start = time.perf_counter()
    result = function(*args)
    return time.perf_counter() - start, result


def run(rows: int = 0, width: int = 0, quick: bool = False) -> list[dict]:
    from pathlib import Path

    from flows import stack
    from pipeline_lib.core import net, runs
    from pipeline_lib.data.convert import convert
    from pipeline_lib.launch.spec import RESULT_NAME
    from pipeline_lib.planning import sharding
    from pipeline_lib.training import loop as training
    from pipeline_lib.training import strategy
    from pipeline_lib.training.results import TrainResult

    steps = QUICK_STEPS if quick else FULL_STEPS
    with tempfile.TemporaryDirectory() as root:
        config = _config(root, steps)
        warm_config = _config(root, 50)
        manifest = convert(config.data, config.output_root)

        def direct(name: str, run_config=config):
            plan = sharding.plan_shards(manifest, num_workers=1, replicas_per_worker=strategy.replicas_per_worker(
                run_config.train), per_replica_batch_size=32, epochs=run_config.train.epochs,
                steps=run_config.train.steps)
            return training.train(run_config, manifest, plan, runs.run_dir_for(run_config.output_root, name))

        server_s, server = _timed(stack.start_prefect_server, Path(root) / "prefect", net.free_port())
        # Set before Prefect is imported: its root settings, which threads outside the flow's context use (the
        # training task's log pump), are read then; without it they start a second, ephemeral server.
        previous_url = os.environ.get("PREFECT_API_URL")
        os.environ["PREFECT_API_URL"] = server.url + "/api"
        from prefect.settings import PREFECT_API_URL, temporary_settings

        from flows.pipeline import training_pipeline

        try:
            with temporary_settings(updates={PREFECT_API_URL: server.url + "/api"}), _logs_sent_before_exit():
                direct("warm-up", warm_config)
                training_pipeline(warm_config)
                order = ["direct", "flow"] if quick else ["direct", "flow", "flow", "direct"]
                times: dict[str, list[float]] = {"direct": [], "flow": []}
                outside: list[float] = []  # per flow run: its wall time minus the train() call in its worker
                for index, kind in enumerate(order):
                    if kind == "direct":
                        seconds, result = _timed(direct, f"direct-{index}")
                    else:
                        seconds, summary = _timed(training_pipeline, config)
                        result = TrainResult.model_validate_json(
                            Path(summary.run_dir, RESULT_NAME).read_text())
                        outside.append(seconds - result.wall_s)
                    assert result.final_step == steps, (kind, result.final_step)
                    times[kind].append(seconds)
                    print(f"  {kind} run {len(times[kind])}: {seconds:.1f}s, of which train() {result.wall_s:.1f}s "
                          f"({steps / result.wall_s:.0f} steps/s)", flush=True)
                    if kind == "flow":
                        print(f"    {_task_times()}", flush=True)
        finally:
            if previous_url is None:
                os.environ.pop("PREFECT_API_URL", None)
            else:
                os.environ["PREFECT_API_URL"] = previous_url
            stack.stop_process(server)
    direct_s = sum(times["direct"]) / len(times["direct"])
    flow_s = sum(times["flow"]) / len(times["flow"])
    outside_s = sum(outside) / len(outside)
    print(f"orchestration: direct train {direct_s:.1f}s | whole flow {flow_s:.1f}s ({steps} steps each, mean of "
          f"{len(times['flow'])}; accuracy {summary.metrics.get('accuracy', float('nan')):.3f}) | difference "
          f"{flow_s - direct_s:.1f}s per run ({100 * (flow_s / direct_s - 1):.1f} % slower)")
    print(f"  the flow's time outside its worker's train() call (Prefect, MLflow run, worker start with its "
          f"TensorFlow import, export, evaluation, registration): {outside_s:.1f}s per run, "
          f"{100 * outside_s / direct_s:.1f} % of the direct training; measured inside each flow run, so it does not "
          f"move with the machine's speed between runs as the wall times do")
    print(f"  a Prefect server took {server_s:.1f}s to start (an ephemeral one adds that once per process)")
    return [
        case(f"flow+MLflow vs direct train ({steps} steps; direct/flow time)", flow_s, direct_s, 1 / 1.1,
             higher_is_better=False),
        # The same comparison with the flow's fixed cost measured inside each flow run (drift-free); what it leaves
        # out is any slowdown of the training loop itself inside the flow, which the row above includes.
        case(f"flow fixed cost outside train() ({steps} steps; direct/(direct+cost))", direct_s + outside_s,
             direct_s, 1 / 1.1, higher_is_better=False),
    ]
