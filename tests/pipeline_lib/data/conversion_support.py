"""Shared helpers of the conversion tests: generated CSV rows, and every record of a converted set read back."""

from __future__ import annotations

import os
import random

import numpy as np
import tensorflow as tf

from pipeline_lib.core import storage
from pipeline_lib.training.input_pipeline import feature_description


def make_rows(num_rows: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [
        {"id": i, "x": round(rng.uniform(-5, 5), 3), "n": rng.randint(-1000, 1000),
         "color": rng.choice(["red", "grün", "", "blue"]), "y": rng.randint(0, 2)}
        for i in range(num_rows)
    ]


def write_csv(path, rows: list[dict], header=("id", "x", "n", "color", "y")) -> str:
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(",".join(header) + "\n")
        handle.writelines(",".join(str(row[c]) for c in header) + "\n" for row in rows)
    return str(path)


def read_all(manifest, split: str | None = None) -> dict[str, np.ndarray]:
    """Every record of the set (or of one split), parsed with the manifest's schema."""
    splits = [split] if split else ["train", "eval"]
    uris = [manifest.shard_uri(s) for sp in splits for s in manifest.shards_for(sp)]
    compression = "GZIP" if manifest.compression == "gzip" else ""
    if any("://" in u and not u.startswith("file://") for u in uris):
        local = []
        for i, uri in enumerate(uris):
            fs, path = storage.get_fs(uri)
            target = f"/tmp/_tfdag_read_{os.getpid()}_{i}"
            fs.get_file(path, target)
            local.append(target)
        uris = local
    dataset = tf.data.TFRecordDataset(uris, compression_type=compression).batch(100_000)
    parsed = {k: [] for k in feature_description(manifest.feature_schema)}
    for batch in dataset:
        for name, value in tf.io.parse_example(batch, feature_description(manifest.feature_schema)).items():
            parsed[name].append(value.numpy())
    return {k: np.concatenate(v) if v else np.array([]) for k, v in parsed.items()}


def split_of_ids(manifest) -> dict[int, str]:
    out = {}
    for split in ("train", "eval"):
        for row_id in read_all(manifest, split)["id"].tolist():
            out[row_id] = split
    return out


def csv_with_bad_rows(path) -> str:
    lines = ["id,size,color,y"] + [f"{i},{i % 5},red,{i % 2}" for i in range(1, 9)]
    lines[5] = "5,abc,red,1"  # line 6: not an int
    lines.insert(8, "")  # a blank line (line 9) is skipped, not counted
    lines[9] = "8,,blue,0"  # line 10: missing value
    lines.append("9,4,green")  # line 11: too few fields
    path.write_text("\n".join(lines) + "\n")
    return str(path)
