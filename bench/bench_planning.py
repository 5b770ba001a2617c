"""Planning at scale: a ShardPlan for 100k files and 64 workers (printed, not asserted)."""

from __future__ import annotations

import random
import time

from bench import case
from pipeline_lib.data.manifest import (
    FeatureSpec,
    Manifest,
    Schema,
    ShardInfo,
    SourceFingerprint,
)
from pipeline_lib.planning.sharding import plan_shards


def synthetic_manifest(num_files: int, seed: int = 0) -> Manifest:
    rng = random.Random(seed)
    shards = tuple(
        ShardInfo(split="train", path=f"train/part-{i:06d}-of-{num_files:06d}.tfrecord",
                  num_records=rng.randint(800, 1200), num_bytes=1 << 20, sha256="0" * 64)
        for i in range(num_files)
    )
    schema = Schema(features=(FeatureSpec(name="x", dtype="float32", shape=(8,)),),
                    label=FeatureSpec(name="y", dtype="int64"), num_classes=2)
    return Manifest(fingerprint="bench", dataset_uri="/bench", feature_schema=schema, shards=shards,
                    source=SourceFingerprint(files=(), sha256="0"))


def run(rows: int = 0, width: int = 0, quick: bool = False) -> list[dict]:
    num_files = 10_000 if quick else 100_000
    manifest = synthetic_manifest(num_files)
    start = time.perf_counter()
    plan = plan_shards(manifest, num_workers=64, replicas_per_worker=1, per_replica_batch_size=32, epochs=1)
    elapsed = time.perf_counter() - start
    print(f"planning: {num_files} files over 64 workers in {elapsed:.3f}s "
          f"(policy {plan.policy.value}, imbalance {plan.imbalance_ratio:.4f}, steps/epoch {plan.steps_per_epoch})")
    # Target: under one second. Expressed as a ratio of the 1 s budget to the time taken (≥ 1 means met).
    return [case(f"plan {num_files} files x 64 workers (s, budget 1s)", elapsed, 1.0, 1.0, higher_is_better=False)]
