"""The Ray launcher vs the local launcher: the same 2-worker MultiWorkerMirrored training on the bundled digits.

A local Ray cluster of 3 nodes on 127.0.0.2 (`flows.stack.ray_cluster`, as `tfdag stack up --ray 3` starts it) and this
process as its driver. Runs are interleaved (local, ray, ray, local; `--quick`: one each, shorter) so a machine
that speeds up or slows down weighs on both alike. From each run's chief log, with the time each line arrived:

- steps/s over the steady state: from the first progress line after the warm-up to the last one;
- start-up seconds: from the launch call to the chief's first progress line (placement, actors, imports).

The case is Ray steps/s over local steps/s (target ≥ 0.95: Ray may add start-up time, not per-step cost); the
median of each side is used, and the spread (max − min over its runs) is printed with the start-up seconds.
Both runs read the data from this machine's disk (every node of the local cluster is on it). Each node offers
NODE_CPUS CPUs and each task reserves them all: Ray caps a task's OMP_NUM_THREADS at the CPUs it reserved, so the
Ray tasks get as many oneDNN threads as the local processes, which have no cap, and the comparison is of the
launchers, not of thread counts.
"""

from __future__ import annotations

import os
import re
import statistics
import tempfile
import threading
import time

from bench import case

FULL_STEPS = 3000
QUICK_STEPS = 400
WARMUP_STEPS = 100
NODE_CPUS = 2
PROGRESS = re.compile(r"\[worker 0(?: @ [0-9.]+)?\] .*train \| step:\s+(\d+)")


class _Log:
    """(arrival time, chief step) of every progress line of the chief."""

    def __init__(self) -> None:
        self.points: list[tuple[float, int]] = []
        self._lock = threading.Lock()

    def __call__(self, line: str) -> None:
        found = PROGRESS.search(line)
        if found:
            with self._lock:
                self.points.append((time.monotonic(), int(found.group(1))))


def steady_rate(points: list[tuple[float, int]], warmup_steps: int) -> float:
    """Steps per second between the first progress line after `warmup_steps` and the last one."""
    steady = [(t, s) for t, s in points if s >= warmup_steps]
    if len(steady) < 2:
        raise ValueError(f"fewer than 2 progress lines after warm-up step {warmup_steps}: {points}")
    (t0, s0), (t1, s1) = steady[0], steady[-1]
    return (s1 - s0) / (t1 - t0)


def _config(root: str, steps: int, launcher: str, address: str | None):
    from pipeline_lib.config import parse_config

    train = {"strategy": "multi_worker_mirrored", "workers": 2, "per_replica_batch_size": 32, "steps": steps,
             "checkpoint_every_steps": steps, "log_every_steps": 50, "shuffle": True, "launcher": launcher}
    if address:
        train["ray"] = {"address": address, "node_ip_address": "127.0.0.2",
                        "resources_per_worker": {"CPU": NODE_CPUS}}
    return parse_config({
        "name": f"bench-{launcher}", "data": {"source": "unused.csv", "label": "target"}, "output_root": root,
        "model": {"factory": "mlp", "params": {"hidden_units": [256, 128]}}, "train": train,
        "preflight": {"enabled": False}, "tracking": {"enabled": False},
    })


def _run(launcher: str, root: str, manifest, steps: int, address: str | None) -> tuple[float, float]:
    from pipeline_lib.launch import launchers
    from pipeline_lib.planning.sharding import AutoShardPolicy
    from tests.conftest import make_plan

    config = _config(os.path.join(root, launcher), steps, launcher, address)
    plan = make_plan(manifest, num_workers=2, replicas_per_worker=1, per_replica_batch_size=32, steps=steps,
                     policy=AutoShardPolicy.DATA)
    log = _Log()
    start = time.monotonic()
    launchers.launch_training(config, manifest, plan, os.path.join(root, launcher, f"run-{time.time_ns()}"),
                              options=launchers.LaunchOptions(log_fn=log))
    if not log.points:
        raise RuntimeError(f"{launcher}: no progress line from the chief")
    return steady_rate(log.points, WARMUP_STEPS), log.points[0][0] - start


def run(quick: bool = False, **_sizes) -> list[dict]:
    import ray

    from flows.stack import ray_cluster
    from tests.pipeline_lib.launch_support import write_digits_dataset

    steps = QUICK_STEPS if quick else FULL_STEPS
    # Interleaved A B B A ..., 5 runs of each side in a full run (the bench's minimum of 5 repetitions).
    order = ["local", "ray"] if quick else ["local", "ray", "ray", "local"] * 2 + ["local", "ray"]
    with tempfile.TemporaryDirectory(prefix="tfdag-bench-ray-") as root:
        manifest = write_digits_dataset(os.path.join(root, "digits"))
        cluster = ray_cluster.start_ray_cluster(3, num_cpus=NODE_CPUS)
        try:
            ray.init(address=cluster.address, _node_ip_address=ray_cluster.RAY_HOST, log_to_driver=False,
                     configure_logging=False)
            results: dict[str, list[tuple[float, float]]] = {"local": [], "ray": []}
            for launcher in order:
                rate, startup = _run(launcher, root, manifest, steps, cluster.address if launcher == "ray" else None)
                results[launcher].append((rate, startup))
                print(f"{launcher:5s}: {rate:8.1f} steps/s, start-up {startup:5.1f} s", flush=True)
        finally:
            if ray.is_initialized():
                ray.shutdown()
            ray_cluster.stop_ray_cluster(cluster)
    samples = {}
    for launcher, runs in results.items():
        rates = [r for r, _ in runs]
        startups = [s for _, s in runs]
        samples[launcher] = rates
        print(f"{launcher:5s} median {statistics.median(rates):.1f} steps/s (spread {max(rates) - min(rates):.1f}), "
              f"start-up median {statistics.median(startups):.1f} s (spread {max(startups) - min(startups):.1f})")
    return [case("ray launcher steps/s vs local (2-worker MWMS)", samples["ray"], samples["local"], 0.95,
                 baseline_name="the local launcher, same 2 workers",
                 bound="the Ray cluster's own processes (raylets, agents, dashboard) sharing the cores with the workers.")]
