"""Orchestration overhead: the whole `training-pipeline` flow (Prefect + MLflow) vs calling `train` directly.

Both run the same config on the bundled digits (conversion done once beforehand and reused by both):
- baseline: `pipeline_lib.training.train(config, manifest, plan, run_dir)` called in this process;
- value: `flows.pipeline.training_pipeline(config)` — Prefect's ephemeral API (started by the flow, as with the
  embedded defaults), the storage check, conversion reuse, validation, planning, an MLflow run with per-step
  metrics, training in a supervised worker process, consolidation and export, evaluation, model registration.
The ratio is direct / flow wall time (≥ 0.909 means the flow is at most 10 % slower); the fixed overhead in
seconds is printed. The training is sized by `train.steps` to take about 3 minutes (`--quick`: ~20 s).
"""

from __future__ import annotations

import os
import tempfile
import time

from bench import case

FULL_STEPS = 27000
QUICK_STEPS = 800


def _config(root: str, steps: int):
    from pipeline_lib import demo_data
    from pipeline_lib.config import parse_config

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


def run(rows: int = 0, width: int = 0, quick: bool = False) -> list[dict]:
    from pipeline_lib import conversion, runs, sharding, strategy, training

    steps = QUICK_STEPS if quick else FULL_STEPS
    with tempfile.TemporaryDirectory() as root:
        config = _config(root, steps)
        manifest = conversion.convert(config.data, config.output_root)
        plan = sharding.plan_shards(manifest, num_workers=1, replicas_per_worker=strategy.replicas_per_worker(
            config.train), per_replica_batch_size=32, epochs=config.train.epochs, steps=steps)

        start = time.perf_counter()
        direct = training.train(config, manifest, plan, runs.run_dir_for(config.output_root, "direct"))
        direct_s = time.perf_counter() - start

        from flows.pipeline import training_pipeline

        start = time.perf_counter()
        summary = training_pipeline(config)
        flow_s = time.perf_counter() - start
    print(f"orchestration: direct train {direct_s:.1f}s ({direct.final_step} steps) | whole flow {flow_s:.1f}s "
          f"({summary.final_step} steps, accuracy {summary.metrics.get('accuracy', float('nan')):.3f}) | "
          f"fixed overhead {flow_s - direct_s:.1f}s ({100 * (flow_s / direct_s - 1):.1f} % slower)")
    return [case(f"flow+MLflow vs direct train ({steps} steps; direct/flow time)", flow_s, direct_s, 1 / 1.1,
                 higher_is_better=False)]
