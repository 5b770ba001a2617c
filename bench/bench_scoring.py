"""Batch scoring: `tfdag predict` from Parquet vs the exported SavedModel called on a hand-written tf.data pipeline
over the same file, and the model's load time in a fresh process.

What is timed, and why it is honest:

* Both sides score the same Parquet file with the same exported SavedModel (`serving_default`, one input per
  column) at the same batch size, and both write every prediction (`prediction` and one `probability_<class>` per
  class) to a Parquet file, chunk by chunk. Both load the SavedModel inside the timed window: each run is what one
  scoring job costs after its process has imported TensorFlow.
* The baseline is the strongest hand-written pipeline on this stack: pyarrow's record batches of the columns the
  model takes (the Parquet decode on pyarrow's threads) into `tf.data.Dataset.from_generator`, the signature called
  in a parallel `map`, `prefetch` on both sides, and a `ParquetWriter` draining it. It checks nothing (tfdag
  names a bad value's file, line and column) and writes no metadata.
* The sides alternate (A, B, A, B) for `repeats` rounds; medians and min-max are recorded.
* The load time is a fresh `python` that imports TensorFlow (outside the window) and then loads the model with
  `tfdag_scoring.Scorer` and scores one row (inside it): what a scoring job or a serving replica waits for before
  its first prediction, on top of the import.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from bench import budget, case, interleaved

BATCH_ROWS = 4096
NUM_CLASSES = 10
TARGET = 0.8
LOAD_BUDGET_S = 3.0

_LOAD_SOURCE = r'''
import json, sys, time
import tensorflow as tf
import pandas as pd
from pipeline_lib.serving.tfdag_scoring import Scorer

start = time.perf_counter()
scorer = Scorer(sys.argv[1])
loaded = time.perf_counter()
scorer.predict(pd.DataFrame({c["name"]: [0.5] for c in scorer.columns}))
print("LOAD", json.dumps({"load": loaded - start, "first": time.perf_counter() - start}), flush=True)
'''


def _table(rows: int, width: int, seed: int):
    import pyarrow as pa

    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, width)).astype(np.float32)
    weights = rng.standard_normal((width, NUM_CLASSES)).astype(np.float32)
    columns = {"id": pa.array(np.arange(rows))}
    columns.update({f"f{j}": pa.array(x[:, j]) for j in range(width)})
    columns["label"] = pa.array(np.argmax(x @ weights, axis=1))
    return pa.table(columns)


def _export(directory: str, width: int) -> str:
    """A real export: a generated table converted, an MLP trained a few steps and consolidated (`saved_model/`)."""
    import pyarrow.parquet as pq

    from pipeline_lib.config import parse_config
    from pipeline_lib.data.convert import convert
    from pipeline_lib.evaluation import consolidation
    from pipeline_lib.planning import sharding
    from pipeline_lib.training import loop as training

    source = os.path.join(directory, "train.parquet")
    pq.write_table(_table(4096, width, seed=1).drop(["id"]), source)
    config = parse_config({
        "name": "bench-scoring", "data": {"source": source, "label": "label"},
        "output_root": os.path.join(directory, "out"), "model": {"params": {"hidden_units": [128, 64]}},
        "train": {"strategy": "default", "per_replica_batch_size": 256, "steps": 20, "checkpoint_every_steps": 20,
                  "log_every_steps": 20},
        "tracking": {"enabled": False}, "preflight": {"enabled": False}})
    manifest = convert(config.data, config.output_root)
    plan = sharding.plan_for_train(manifest, config.train, 1)
    result = training.train(config, manifest, plan, os.path.join(directory, "run"))
    export_dir = os.path.join(directory, "run", "export")
    consolidation.consolidate(config, manifest, result, export_dir)
    return export_dir


def _tfdag(export_dir: str, source: str, output: str) -> int:
    from pipeline_lib.config import PredictConfig
    from pipeline_lib.prediction.predict import predict

    return predict(PredictConfig(model=export_dir, input=source, output=output, batch_rows=BATCH_ROWS)).num_rows


def _baseline(saved_model_dir: str, source: str, output: str) -> int:
    """The SavedModel's serving_default mapped over a tf.data pipeline of the file's record batches."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import tensorflow as tf

    from pipeline_lib.serving.tfdag_scoring import read_serving_spec

    spec = read_serving_spec(saved_model_dir)
    names = [c["name"] for c in spec["columns"]]
    inputs = {c["name"]: c["input"] for c in spec["columns"]}
    loaded = tf.saved_model.load(saved_model_dir)  # held: the signature references its variables
    serve = loaded.signatures["serving_default"]
    labels = spec["label"]["values"]

    def batches():
        for batch in pq.ParquetFile(source).iter_batches(batch_size=BATCH_ROWS, columns=names):
            yield {inputs[n]: batch.column(n).to_numpy().astype(np.float32) for n in names}

    signature = {inputs[n]: tf.TensorSpec([None], tf.float32) for n in names}
    dataset = (tf.data.Dataset.from_generator(batches, output_signature=signature)
               .prefetch(tf.data.AUTOTUNE)
               .map(lambda batch: serve(**batch), num_parallel_calls=tf.data.AUTOTUNE)
               .prefetch(tf.data.AUTOTUNE))
    rows, writer = 0, None
    for outputs in dataset:
        probabilities = outputs["probabilities"].numpy()
        table = pa.table({"prediction": outputs["prediction"].numpy(),
                          **{f"probability_{v}": probabilities[:, i] for i, v in enumerate(labels)}})
        writer = writer or pq.ParquetWriter(output, table.schema)
        writer.write_table(table)
        rows += table.num_rows
    if writer is not None:
        writer.close()
    del loaded
    return rows


def _load_times(saved_model_dir: str, repeats: int) -> tuple[list[float], list[float]]:
    loads, firsts = [], []
    for _ in range(repeats):
        out = subprocess.run([sys.executable, "-c", _LOAD_SOURCE, saved_model_dir], capture_output=True, text=True,
                             check=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                             env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
        times = json.loads(out.stdout.split("LOAD", 1)[1])
        loads.append(times["load"])
        firsts.append(times["first"])
    return loads, firsts


def run(rows: int = 1_000_000, width: int = 32, quick: bool = False) -> list[dict]:
    import pyarrow.parquet as pq

    rows = min(rows, 100_000) if quick else rows
    repeats = 2 if quick else 5
    with tempfile.TemporaryDirectory() as directory:
        export_dir = _export(directory, width)
        saved_model_dir = os.path.join(export_dir, "saved_model")
        source = os.path.join(directory, "score.parquet")
        pq.write_table(_table(rows, width, seed=2), source, row_group_size=65536)
        rates: dict[str, list[float]] = {}

        def rate(name, fn):
            def step() -> float:
                start = time.perf_counter()
                scored = fn(source, os.path.join(directory, f"{name}.parquet"))
                elapsed = time.perf_counter() - start
                assert scored == rows, (name, scored, rows)
                rates.setdefault(name, []).append(rows / elapsed)
                return rows / elapsed
            return step

        samples = interleaved({"tfdag": rate("tfdag", lambda s, o: _tfdag(export_dir, s, o)),
                               "baseline": rate("baseline", lambda s, o: _baseline(saved_model_dir, s, o))},
                              repeats)
        loads, firsts = _load_times(saved_model_dir, repeats)
    print(f"scoring ({rows} rows x {width} float columns, batch {BATCH_ROWS}, medians of {repeats} interleaved "
          "rounds):")
    for name, values in samples.items():
        print(f"  {name:<9} {float(np.median(values)):>12,.0f} rows/s (min {min(values):,.0f}, max {max(values):,.0f})")
    print(f"  model load in a fresh process: {float(np.median(loads)):.2f} s, first prediction after "
          f"{float(np.median(firsts)):.2f} s (TensorFlow's import not counted)")
    return [
        case(f"tfdag predict from Parquet vs SavedModel on tf.data, batch {BATCH_ROWS} (rows/s)", samples["tfdag"],
             samples["baseline"], TARGET, unit="rows/s",
             baseline_name="pyarrow batches → tf.data.from_generator → map(serving_default) → ParquetWriter",
             bound="the model call on the machine's cores on both sides; tfdag converts and checks every value on "
                   "a helper thread and writes on another, the baseline trusts the file's types."),
        budget("model load in a fresh process, to the first prediction (s)", firsts, LOAD_BUDGET_S,
               bound="tf.saved_model.load of the SavedModel and the first call's set-up; TensorFlow's import "
                     "comes before it"),
    ]
