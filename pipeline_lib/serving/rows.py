"""Raw table rows back out of the converted shards: what a model's input example and checks are made of."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pandas as pd
import tensorflow as tf

from pipeline_lib.data.manifest import DType, Manifest, TimeKind
from pipeline_lib.data.statistics import MISSING_INT64
from pipeline_lib.data.tfdag_instants import MICROS_PER_DAY
from pipeline_lib.serving.signatures import examples_to_raw, input_names
from pipeline_lib.training import input_pipeline, staging


def example_split(manifest: Manifest) -> str:
    """The split examples come from: eval, or train when there is no eval split."""
    return "eval" if manifest.num_records("eval") else "train"


def raw_rows(manifest: Manifest, num_rows: int = 5, *, split: str | None = None,
             storage_options: Mapping[str, Any] | None = None) -> pd.DataFrame:
    """The first `num_rows` records of a split as the table's own rows: one column per feature, numbers as
    float64 (each float32's shortest decimal) with NaN for a missing value, strings as str with None for a missing
    one, vectors as lists, dates and timestamps as naive datetime64[us] in UTC (a date at midnight) with NaT for a
    missing one."""
    split = split or example_split(manifest)
    local = staging.stage_split(manifest, split, storage_options=dict(storage_options or {}))
    compression = "GZIP" if local.compression == "gzip" else ""
    dataset = tf.data.TFRecordDataset(input_pipeline.shard_uris(local, split), compression_type=compression)
    serialized = next(iter(dataset.take(num_rows).batch(num_rows)))
    columns = examples_to_raw(manifest.feature_schema, serialized)
    names = input_names(manifest.feature_schema)
    frame: dict[str, Any] = {}
    for spec in manifest.feature_schema.features:
        values = columns[names[spec.name]].numpy()
        if spec.time is not None:
            missing = values == MISSING_INT64
            stamps = (np.where(missing, 0, values) * (MICROS_PER_DAY if spec.time == TimeKind.DATE else 1)
                      ).astype("datetime64[us]")
            stamps[missing] = np.datetime64("NaT")
            frame[spec.name] = stamps
        elif spec.dtype == DType.STRING:
            decoded = np.vectorize(lambda v: v.decode() if v else None, otypes=[object])(values)
            frame[spec.name] = list(decoded) if spec.shape else decoded
        else:
            # The shortest decimal of each float32 (13.16, not 13.15999984741211): the number as the source wrote
            # it, and the same float32 again when the model reads it.
            values = values.astype(str).astype(np.float64)
            frame[spec.name] = [row.tolist() for row in values] if spec.shape else values
    return pd.DataFrame(frame)
