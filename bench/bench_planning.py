"""Planning at scale: a ShardPlan for 100k files over 64 workers, a budget (< 1 s), and at 10,000 shards."""

from __future__ import annotations

import random
import time

from bench import budget
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


def run(rows: int = 0, width: int = 0, quick: bool = False, repeats: int = 5) -> list[dict]:
    num_files = 10_000 if quick else 100_000
    manifest = synthetic_manifest(num_files)
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        plan = plan_shards(manifest, num_workers=64, replicas_per_worker=1, per_replica_batch_size=32, epochs=1)
        seconds.append(time.perf_counter() - start)
    print(f"planning: {num_files} files over 64 workers in {min(seconds):.3f}-{max(seconds):.3f}s over {repeats} runs "
          f"(policy {plan.policy.value}, imbalance {plan.imbalance_ratio:.4f}, steps/epoch {plan.steps_per_epoch})")
    return [budget(f"plan {num_files} files over 64 workers (s)", seconds, 1.0,
                   bound="a budget, not a comparison: pure Python over the manifest's shard list, which grows with the "
                         "number of files.")]
