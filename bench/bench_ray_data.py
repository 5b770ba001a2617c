"""The Ray data engine vs the local engine: conversion rows/s of the same CSV files on the same cores.

A one-node Ray cluster on 127.0.0.2 (`flows.stack.ray_cluster`) offering this machine's cores, and this process as
its driver: the Ray engine converts one file per task on those cores, the local engine in this process with its
encoding, writing and statistics threads. Runs are interleaved (local, ray, ...; REPEATS each) into fresh output
roots. The case is the Ray engine's rows/s over the local engine's (target ≥ 0.7: the same cores, plus Ray's task
start-up, its workers' imports, and the merge of the partial statistics on the driver).
"""

from __future__ import annotations

import os
import tempfile

from bench import case, interleaved, seconds_of
from bench.bench_conversion import write_csv

REPEATS = 5
FILES = 8


def run(rows: int = 1_600_000, width: int = 16, quick: bool = False, repeats: int = REPEATS) -> list[dict]:
    import ray

    from flows.stack import ray_cluster
    from pipeline_lib.config import DataConfig, DataEngine, RayConfig
    from pipeline_lib.data.convert import convert

    if quick:
        rows, repeats = min(rows, 80_000), 2
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    with tempfile.TemporaryDirectory(prefix="tfdag-bench-ray-data-") as work:
        os.makedirs(os.path.join(work, "src"))
        for number in range(FILES):
            write_csv(os.path.join(work, "src", f"part{number}.csv"), rows // FILES, width, seed=number)
        data = DataConfig(source=os.path.join(work, "src", "*.csv"), label="label")
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
        cluster = ray_cluster.start_ray_cluster(1, num_cpus=cores, env=env)
        try:
            ray.init(address=cluster.address, _node_ip_address=ray_cluster.RAY_HOST, log_to_driver=False,
                     configure_logging=False)
            on_ray = data.model_copy(update={"engine": DataEngine.RAY})
            address = RayConfig(address=cluster.address, node_ip_address=ray_cluster.RAY_HOST)
            convert(on_ray, os.path.join(work, "warm"), ray=address)  # the node's workers started and imported
            counter = iter(range(1_000_000))

            def local() -> None:
                convert(data, os.path.join(work, f"local-{next(counter)}"))

            def remote() -> None:
                convert(on_ray, os.path.join(work, f"ray-{next(counter)}"), ray=address)

            seconds = interleaved({"local": seconds_of(local), "ray": seconds_of(remote)}, repeats, before=os.sync)
        finally:
            if ray.is_initialized():
                ray.shutdown()
            ray_cluster.stop_ray_cluster(cluster)
    rates = {name: [rows / s for s in samples] for name, samples in seconds.items()}
    print(f"ray data: {rows} rows x {width} floats in {FILES} CSV files on {cores} core(s): "
          f"local {rates['local']}, ray {rates['ray']} rows/s")
    return [case(f"ray engine conversion rows/s vs local ({FILES} CSV files, {cores} cores)", rates["ray"],
                 rates["local"], 0.7, unit="rows/s", baseline_name="the local engine on the same files and cores",
                 bound="one task per file on the node's cores, against the local engine's pipeline of threads; the "
                       "driver's listing, schema inference and statistics merge are serial.")]
