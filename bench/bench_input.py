"""Input pipeline: what the trainer reads (`create_dataset`) vs per-example parsing and a raw sequential read.

Every dataset is drained inside TensorFlow (`Dataset.reduce`), the way the trainer consumes it (`next` inside
a `tf.function`), so no case pays Python's per-element cost (~50 µs an element here, which alone would cap a
batch-32 pipeline). Rates are rows per second of wall time; each dataset is drained `repeats` times, the
three kinds alternating, and the best run kept, so bursts of load from other jobs favour none of them. CPU
time per row (all threads of this process) is printed too: it does not depend on the machine's other load.
"""

from __future__ import annotations

import os
import tempfile
import time

import numpy as np

from bench import case

BATCH_SIZES = (32, 256, 1024)


def _write_records(path: str, rows: int, width: int, num_classes: int = 10) -> None:
    import tensorflow as tf

    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, width)).astype(np.float32)
    y = rng.integers(0, num_classes, size=rows)
    with tf.io.TFRecordWriter(path) as writer:
        for i in range(rows):
            example = tf.train.Example(features=tf.train.Features(feature={
                **{f"f{j}": tf.train.Feature(float_list=tf.train.FloatList(value=[x[i, j]])) for j in range(width)},
                "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[int(y[i])])),
            }))
            writer.write(example.SerializeToString())


def _manifest(directory: str, width: int, rows: int, num_classes: int = 10):
    from pipeline_lib.manifest import (
        FeatureSpec,
        Manifest,
        Schema,
        ShardInfo,
        SourceFingerprint,
    )

    schema = Schema(features=tuple(FeatureSpec(name=f"f{j}", dtype="float32") for j in range(width)),
                    label=FeatureSpec(name="label", dtype="int64"), num_classes=num_classes)
    shard = ShardInfo(split="train", path="part.tfrecord", num_records=rows,
                      num_bytes=os.path.getsize(os.path.join(directory, "part.tfrecord")), sha256="0" * 64)
    return Manifest(fingerprint="bench", dataset_uri=directory, feature_schema=schema, shards=(shard,),
                    source=SourceFingerprint(files=(), sha256="0"))


def drain(dataset, rows_of) -> tuple[float, float]:
    """Consume `dataset` inside TensorFlow; (rows/s of wall time, CPU µs per row of this process)."""
    import tensorflow as tf

    @tf.autograph.experimental.do_not_convert
    def add(total, element):
        return total + tf.cast(tf.shape(rows_of(element))[0], tf.int64)

    wall, cpu = time.perf_counter(), time.process_time()
    rows = int(dataset.reduce(tf.constant(0, tf.int64), add))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return rows / wall, cpu / rows * 1e6


def run(rows: int = 200_000, width: int = 32, quick: bool = False) -> list[dict]:
    import tensorflow as tf

    from pipeline_lib import input_pipeline

    rows = min(rows, 50_000) if quick else rows
    repeats = 2 if quick else 3
    cases = []
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "part.tfrecord")
        _write_records(path, rows, width)
        manifest = _manifest(directory, width, rows)
        spec = input_pipeline.feature_description(manifest.feature_schema)

        def raw():
            # The pipeline's own reader settings, doing nothing but read and batch the serialized records.
            return tf.data.TFRecordDataset(path, buffer_size=input_pipeline.READ_BUFFER_BYTES).batch(1024)

        def per_example(batch):
            return tf.data.TFRecordDataset(path).map(lambda r: tf.io.parse_single_example(r, spec)).batch(batch)

        best: dict[str, tuple[float, float]] = {}

        def measure(name, make, rows_of):
            rate, cpu = drain(make(), rows_of)
            old = best.get(name, (0.0, float("inf")))
            best[name] = (max(old[0], rate), min(old[1], cpu))

        for _ in range(repeats):
            measure("raw", raw, lambda e: e)
            for batch in BATCH_SIZES:
                measure(f"tfdag {batch}", lambda b=batch: input_pipeline.create_dataset(manifest, "train", b),
                        lambda e: e[1])
            measure("per-example", lambda: per_example(1024), lambda e: e["label"])

    raw_rate, raw_cpu = best["raw"]
    per_rate, per_cpu = best["per-example"]
    print(f"input ({rows} rows x {width} float features, best of {repeats}): raw read {raw_rate:,.0f} rows/s "
          f"({raw_cpu:.2f} CPU µs/row) | per-example parse, batch 1024: {per_rate:,.0f} rows/s ({per_cpu:.2f})")
    for batch in BATCH_SIZES:
        rate, cpu = best[f"tfdag {batch}"]
        print(f"  create_dataset batch {batch:>4}: {rate:,.0f} rows/s ({cpu:.2f} CPU µs/row) = "
              f"{rate / per_rate:.1f}x per-example, {rate / raw_rate:.2f}x raw read")
        cases.append(case(f"create_dataset b{batch} vs per-example parse (rows/s)", rate, per_rate, 10.0))
        cases.append(case(f"create_dataset b{batch} vs raw read (rows/s)", rate, raw_rate, 0.5))
    return cases
