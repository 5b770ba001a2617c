"""Input pipeline: what the trainer reads (`create_dataset`) vs TensorFlow's guide pipeline and a raw parallel read.

The baseline is the vectorized pipeline of TensorFlow's tf.data performance guide: the shards read in parallel
(`interleave` of `TFRecordDataset`s), `batch`, then `parse_example` mapped in parallel, `prefetch`. The raw read
is the same parallel read of the serialized records, batched, with no parsing: the rate the files can be read at.
Every dataset is drained inside TensorFlow (`Dataset.reduce`), the way the trainer consumes it (`next` inside
a `tf.function`), so no case pays Python's per-element cost. Rates are rows per second of wall time; the
datasets are drained in turn, `repeats` rounds, and medians with min-max recorded. CPU time per row (all
threads of this process) is printed too: it does not depend on the machine's other load.
"""

from __future__ import annotations

import os
import tempfile
import time

import numpy as np

from bench import case, interleaved

BATCH_SIZES = (32, 256, 1024)


def _write_records(paths: list[str], rows: int, width: int, num_classes: int = 10):
    """`rows` Examples of `width` scalar float features f0.. and an int64 label over `paths` (equal parts), written
    with tfdag's bulk encoder: the bytes `tf.io.TFRecordWriter` writes for them (tests/pipeline_lib/data/
    test_framing.py checks that). Returns the records' byte layout, as conversion records it in the manifest.
    """
    from pipeline_lib.data.framing import encode_tfrecords
    from pipeline_lib.data.record_layout import record_layout
    from pipeline_lib.data.tfrecord_writer import TFRecordFileWriter

    rng = np.random.default_rng(0)
    layouts = set()
    per_file = -(-rows // len(paths))
    index, writer = 0, TFRecordFileWriter(paths[0])
    try:
        # Chunks of 65536 rows, each encoded once and cut at the files' row boundaries: thousands of small
        # files cost no more encoding than one.
        for start in range(0, rows, 65536):
            n = min(65536, rows - start)
            x = rng.standard_normal((n, width)).astype(np.float32)
            columns = {f"f{j}": np.ascontiguousarray(x[:, j]) for j in range(width)}
            columns["label"] = rng.integers(0, num_classes, size=n)
            layouts.add(record_layout(columns))
            batch = encode_tfrecords(columns)
            done = 0
            while done < n:
                take = min(n - done, (index + 1) * per_file - (start + done))
                writer.write(batch, done, done + take)
                done += take
                if start + done == (index + 1) * per_file and index + 1 < len(paths):
                    writer.close()
                    index += 1
                    writer = TFRecordFileWriter(paths[index])
    finally:
        writer.close()
    for path in paths[index + 1:]:  # more files than rows: the rest are empty
        TFRecordFileWriter(path).close()
    return next(iter(layouts)) if len(layouts) == 1 else None


def _manifest(directory: str, names: list[str], width: int, rows: int, layout, num_classes: int = 10):
    from pipeline_lib.data.manifest import (
        FeatureSpec,
        Manifest,
        Schema,
        ShardInfo,
        SourceFingerprint,
    )

    schema = Schema(features=tuple(FeatureSpec(name=f"f{j}", dtype="float32") for j in range(width)),
                    label=FeatureSpec(name="label", dtype="int64"), num_classes=num_classes)
    per_file = -(-rows // len(names))
    shards = tuple(ShardInfo(split="train", path=name, num_records=max(0, min(per_file, rows - i * per_file)),
                             num_bytes=os.path.getsize(os.path.join(directory, name)), sha256="0" * 64)
                   for i, name in enumerate(names))
    return Manifest(fingerprint="bench", dataset_uri=directory, feature_schema=schema, shards=shards,
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


def guide_pipeline(paths: list[str], batch_size: int, spec):
    """TensorFlow's tf.data guide, vectorized: parallel interleaved reads, batch, parse_example, prefetch."""
    import tensorflow as tf

    autotune = tf.data.AUTOTUNE
    return (tf.data.Dataset.from_tensor_slices(paths)
            .interleave(tf.data.TFRecordDataset, cycle_length=len(paths), num_parallel_calls=autotune)
            .batch(batch_size)
            .map(lambda records: tf.io.parse_example(records, spec), num_parallel_calls=autotune)
            .prefetch(autotune))


def raw_read(paths: list[str], batch_size: int = 1024):
    """The guide's parallel read of the serialized records, batched, no parsing."""
    import tensorflow as tf

    from pipeline_lib.training import input_pipeline

    return (tf.data.Dataset.from_tensor_slices(paths)
            .interleave(lambda path: tf.data.TFRecordDataset(path, buffer_size=input_pipeline.READ_BUFFER_BYTES),
                        cycle_length=len(paths), num_parallel_calls=tf.data.AUTOTUNE)
            .batch(batch_size).prefetch(tf.data.AUTOTUNE))


def run(rows: int = 1_000_000, width: int = 32, quick: bool = False, num_files: int = 8) -> list[dict]:
    from pipeline_lib.training import input_pipeline

    rows = min(rows, 50_000) if quick else rows
    repeats = 2 if quick else 5
    with tempfile.TemporaryDirectory() as directory:
        names = [f"part-{i:05d}.tfrecord" for i in range(num_files)]
        paths = [os.path.join(directory, name) for name in names]
        layout = _write_records(paths, rows, width)
        manifest = _manifest(directory, names, width, rows, layout)
        parsed_manifest = manifest.model_copy(update={"record_layout": None})  # the same records, parsed
        spec = input_pipeline.feature_description(manifest.feature_schema)
        cpu: dict[str, list[float]] = {}

        def drained(make, rows_of, name):
            def step() -> float:
                rate, cpu_us = drain(make(), rows_of)
                cpu.setdefault(name, []).append(cpu_us)
                return rate
            return step

        steps = {"raw": drained(lambda: raw_read(paths), lambda e: e, "raw"),
                 "guide 256": drained(lambda: guide_pipeline(paths, 256, spec), lambda e: e["label"], "guide 256")}
        for batch in BATCH_SIZES:
            steps[f"tfdag {batch}"] = drained(lambda b=batch: input_pipeline.create_dataset(manifest, "train", b),
                                              lambda e: e[1], f"tfdag {batch}")
        steps["parse 256"] = drained(lambda: input_pipeline.create_dataset(parsed_manifest, "train", 256),
                                     lambda e: e[1], "parse 256")
        samples = interleaved(steps, repeats)

    def median(name: str) -> float:
        return float(np.median(samples[name]))

    print(f"input ({rows} rows x {width} float features in {num_files} files, medians of {repeats} interleaved "
          "rounds; rows/s, CPU µs/row):")
    for name in steps:
        print(f"  {name:<10} {median(name):>12,.0f} rows/s (min {min(samples[name]):,.0f}, max "
              f"{max(samples[name]):,.0f}), {float(np.median(cpu[name])):.2f} CPU µs/row")
    raw_name = "parallel raw read of the serialized records"
    cases = [case("create_dataset b256 vs TF guide's vectorized pipeline b256 (rows/s)", samples["tfdag 256"],
                  samples["guide 256"], 1.5, unit="rows/s",
                  baseline_name="interleave(TFRecordDataset) + batch + parse_example + prefetch",
                  bound="parse_example's protobuf decoding in the baseline against one gather and bitcast of the "
                        "manifest's fixed record layout in tfdag.")]
    for batch in BATCH_SIZES:
        cases.append(case(f"create_dataset b{batch} vs raw parallel read (rows/s)", samples[f"tfdag {batch}"],
                          samples["raw"], 0.9, unit="rows/s", baseline_name=raw_name,
                          bound="tfdag reads its files one after the other, in order (deterministic batches), "
                                "where the raw read interleaves them; the parse costs CPU beside the read."))
    return cases
