"""Input pipeline: what the trainer reads (batched parse) vs per-example parsing and a raw sequential read."""

from __future__ import annotations

import os
import tempfile
import time

import numpy as np

from bench import case


def _write_records(path: str, rows: int, width: int) -> None:
    import tensorflow as tf

    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, width)).astype(np.float32)
    y = rng.integers(0, 10, size=rows)
    with tf.io.TFRecordWriter(path) as writer:
        for i in range(rows):
            example = tf.train.Example(features=tf.train.Features(feature={
                **{f"f{j}": tf.train.Feature(float_list=tf.train.FloatList(value=[x[i, j]])) for j in range(width)},
                "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[int(y[i])])),
            }))
            writer.write(example.SerializeToString())


def _manifest(directory: str, width: int, rows: int):
    from pipeline_lib.manifest import FeatureSpec, Manifest, Schema, ShardInfo, SourceFingerprint

    schema = Schema(features=tuple(FeatureSpec(name=f"f{j}", dtype="float32") for j in range(width)),
                    label=FeatureSpec(name="label", dtype="int64"), num_classes=10)
    shard = ShardInfo(split="train", path="part.tfrecord", num_records=rows,
                      num_bytes=os.path.getsize(os.path.join(directory, "part.tfrecord")), sha256="0" * 64)
    return Manifest(fingerprint="bench", dataset_uri=directory, feature_schema=schema, shards=(shard,),
                    source=SourceFingerprint(files=(), sha256="0"))


def _rate(dataset, rows_per_element) -> float:
    start = time.perf_counter()
    count = 0
    for element in dataset:
        count += rows_per_element(element)
    return count / (time.perf_counter() - start)


def run(rows: int = 200_000, width: int = 32, quick: bool = False) -> list[dict]:
    import tensorflow as tf

    from pipeline_lib import input_pipeline

    rows = min(rows, 50_000) if quick else rows
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "part.tfrecord")
        _write_records(path, rows, width)
        manifest = _manifest(directory, width, rows)
        spec = input_pipeline.feature_description(manifest.feature_schema)
        batch = 1024

        raw = _rate(tf.data.TFRecordDataset(path).batch(batch), lambda e: int(e.shape[0]))
        per_example = _rate(
            tf.data.TFRecordDataset(path).map(lambda r: tf.io.parse_single_example(r, spec)).batch(batch),
            lambda e: int(e["label"].shape[0]),
        )
        trainer = _rate(input_pipeline.create_dataset(manifest, "train", batch), lambda e: int(e[1].shape[0]))
    print(f"input: raw read {raw:,.0f} rows/s | per-example parse {per_example:,.0f} rows/s | "
          f"tfdag pipeline {trainer:,.0f} rows/s ({rows} rows x {width} floats)")
    return [
        case("input pipeline vs per-example parsing (rows/s)", trainer, per_example, 10.0),
        case("input pipeline vs raw sequential read (rows/s)", trainer, raw, 0.5),
    ]
