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


def _write_records(path: str, rows: int, width: int, num_classes: int = 10):
    """`rows` Examples of `width` scalar float features f0.. and an int64 label, written with tfdag's bulk encoder:
    the bytes `tf.io.TFRecordWriter` writes for them (tests/pipeline_lib/data/test_framing.py checks that), at a rate that lets
    the bench use a million rows without a minutes-long per-row setup. Returns the records' byte layout, as
    conversion records it in the manifest (None if the chunks' layouts differ).
    """
    from pipeline_lib.data.framing import encode_tfrecords
    from pipeline_lib.data.record_layout import record_layout
    from pipeline_lib.data.tfrecord_writer import TFRecordFileWriter

    rng = np.random.default_rng(0)
    writer = TFRecordFileWriter(path)
    layouts = set()
    try:
        for start in range(0, rows, 65536):
            n = min(65536, rows - start)
            x = rng.standard_normal((n, width)).astype(np.float32)
            columns = {f"f{j}": np.ascontiguousarray(x[:, j]) for j in range(width)}
            columns["label"] = rng.integers(0, num_classes, size=n)
            layouts.add(record_layout(columns))
            writer.write(encode_tfrecords(columns))
    finally:
        writer.close()
    return next(iter(layouts)) if len(layouts) == 1 else None


def _manifest(directory: str, width: int, rows: int, layout, num_classes: int = 10):
    from pipeline_lib.data.manifest import (
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
                    source=SourceFingerprint(files=(), sha256="0"), record_layout=layout)


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


def run(rows: int = 1_000_000, width: int = 32, quick: bool = False) -> list[dict]:
    import tensorflow as tf

    from pipeline_lib.training import input_pipeline

    rows = min(rows, 50_000) if quick else rows
    repeats = 2 if quick else 3
    cases = []
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "part.tfrecord")
        layout = _write_records(path, rows, width)
        manifest = _manifest(directory, width, rows, layout)
        parsed_manifest = manifest.model_copy(update={"record_layout": None})  # the same records, parsed
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
            measure("parse 256", lambda: input_pipeline.create_dataset(parsed_manifest, "train", 256), lambda e: e[1])
            measure("per-example", lambda: per_example(1024), lambda e: e["label"])

    raw_rate, raw_cpu = best["raw"]
    per_rate, per_cpu = best["per-example"]
    print(f"input ({rows} rows x {width} float features, best of {repeats}): raw read {raw_rate:,.0f} rows/s "
          f"({raw_cpu:.2f} CPU µs/row) | per-example parse, batch 1024: {per_rate:,.0f} rows/s ({per_cpu:.2f})")
    parse_rate, parse_cpu = best["parse 256"]
    print(f"  create_dataset batch  256 with no record layout in the manifest (ParseExampleDataset): "
          f"{parse_rate:,.0f} rows/s ({parse_cpu:.2f} CPU µs/row) = {parse_rate / raw_rate:.2f}x raw read")
    for batch in BATCH_SIZES:
        rate, cpu = best[f"tfdag {batch}"]
        print(f"  create_dataset batch {batch:>4} (the manifest's record layout): {rate:,.0f} rows/s ({cpu:.2f} CPU µs/row) = "
              f"{rate / per_rate:.1f}x per-example, {rate / raw_rate:.2f}x raw read")
        cases.append(case(f"create_dataset b{batch} vs per-example parse (rows/s)", rate, per_rate, 10.0))
        cases.append(case(f"create_dataset b{batch} vs raw read (rows/s)", rate, raw_rate, 0.5))
    return cases
