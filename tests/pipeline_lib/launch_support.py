"""Helpers for the launcher, worker, fault and equivalence tests: datasets on disk, specs, weights, orphans."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from typing import Any

import numpy as np
import psutil

from pipeline_lib.config import PipelineConfig, parse_config
from pipeline_lib.data.manifest import (
    DType,
    FeatureSpec,
    Manifest,
    Schema,
    ShardInfo,
    SourceFingerprint,
)
from pipeline_lib.launch.spec import WorkerSpec
from pipeline_lib.planning.sharding import AutoShardPolicy, ShardPlan
from tests.conftest import make_plan, write_dataset

# The repository root: the working directory and PYTHONPATH of the processes the tests start.
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def write_dataset_on_disk(root: str, **kwargs) -> Manifest:
    """The conftest dataset plus its manifest.json, so worker processes can load it."""
    manifest = write_dataset(root, **kwargs)
    with open(os.path.join(root, "manifest.json"), "w") as handle:
        handle.write(manifest.to_json())
    return manifest


def write_digits_dataset(root: str, *, example_ids: bool = False) -> Manifest:
    """scikit-learn's bundled 8x8 digits (no download) as TFRecords: x = 64 pixels / 16, label 0..9; with
    `example_ids`, also the float feature `example_id`: each row's index in its split's file, divided by
    `EXAMPLE_ID_SCALE` (what the test-only recorder multiplies back)."""
    import tensorflow as tf
    from sklearn.datasets import load_digits

    from pipeline_lib.testing.example_ids import EXAMPLE_ID_SCALE

    digits = load_digits()
    features = (digits.data / 16.0).astype(np.float32)
    labels = digits.target.astype(np.int64)
    order = np.random.default_rng(0).permutation(len(labels))
    features, labels = features[order], labels[order]
    num_eval = 360
    shards = []
    for split, rows in (("train", slice(num_eval, None)), ("eval", slice(0, num_eval))):
        os.makedirs(os.path.join(root, split), exist_ok=True)
        relative = f"{split}/part-00000-of-00001.tfrecord"
        path = os.path.join(root, relative)
        with tf.io.TFRecordWriter(path) as writer:
            for index, (x, y) in enumerate(zip(features[rows], labels[rows], strict=True)):
                feature = {
                    "x": tf.train.Feature(float_list=tf.train.FloatList(value=x.tolist())),
                    "target": tf.train.Feature(int64_list=tf.train.Int64List(value=[int(y)])),
                }
                if example_ids:
                    feature["example_id"] = tf.train.Feature(float_list=tf.train.FloatList(value=[index / EXAMPLE_ID_SCALE]))
                example = tf.train.Example(features=tf.train.Features(feature=feature))
                writer.write(example.SerializeToString())
        with open(path, "rb") as handle:
            digest = hashlib.sha256(handle.read()).hexdigest()
        shards.append(ShardInfo(split=split, path=relative, num_records=len(labels[rows]),
                                num_bytes=os.path.getsize(path), sha256=digest))
    ids = (FeatureSpec(name="example_id", dtype=DType.FLOAT32),) if example_ids else ()
    schema = Schema(features=(FeatureSpec(name="x", dtype=DType.FLOAT32, shape=(64,)), *ids),
                    label=FeatureSpec(name="target", dtype=DType.INT64), num_classes=10)
    manifest = Manifest(fingerprint="digits", dataset_uri=root, feature_schema=schema, shards=tuple(shards),
                        source=SourceFingerprint(files=(), sha256="0" * 64))
    with open(os.path.join(root, "manifest.json"), "w") as handle:
        handle.write(manifest.to_json())
    return manifest


def make_config(root: str, *, label: str = "label", model: dict | None = None, preflight: bool = False,
                tracking: dict | None = None, **train: Any) -> PipelineConfig:
    """A small pipeline config: tiny MLP, no shuffle unless asked, fast supervisor settings."""
    settings = {"per_replica_batch_size": 32, "checkpoint_every_steps": 10, "log_every_steps": 10,
                "hang_timeout_s": 30.0, "restart_backoff_s": 0.1, "shuffle": False, "max_restarts": 3}
    settings.update(train)
    return parse_config({
        "name": "launch-test",
        "data": {"source": "unused.csv", "label": label},
        "output_root": root,
        "model": model or {"factory": "mlp", "params": {"hidden_units": [8]}},
        "train": settings,
        "preflight": {"enabled": preflight},
        "tracking": tracking or {"enabled": False},
    })


def make_spec(config: PipelineConfig, manifest: Manifest, plan: ShardPlan, run_dir: str) -> WorkerSpec:
    return WorkerSpec(config=config.model_dump(mode="json"), dataset_uri=manifest.dataset_uri, plan=plan,
                      run_dir=run_dir, heartbeat_dir=os.path.join(run_dir, "heartbeats"))


def plan_for(manifest: Manifest, config: PipelineConfig, *, steps: int, replicas_per_worker: int = 1,
             num_workers: int | None = None) -> ShardPlan:
    workers = config.train.workers if num_workers is None else num_workers
    return make_plan(manifest, num_workers=workers, replicas_per_worker=replicas_per_worker,
                     per_replica_batch_size=config.train.per_replica_batch_size, steps=steps,
                     policy=AutoShardPolicy.DATA)


class LogCapture:
    """A thread-safe log_fn that keeps (monotonic time, line) pairs."""

    def __init__(self) -> None:
        self.lines: list[tuple[float, str]] = []
        self._lock = threading.Lock()

    def __call__(self, line: str) -> None:
        with self._lock:
            self.lines.append((time.monotonic(), line))

    @property
    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def first_time(self, needle: str) -> float | None:
        return next((t for t, line in self.lines if needle in line), None)


def assert_no_orphans(timeout_s: float = 10.0) -> None:
    """No process started by this test process is still alive (zombies reaped or not, running ones count)."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [p for p in psutil.Process().children(recursive=True)
                 if _is_running(p) and "pipeline_lib.launch.worker" in " ".join(_cmdline(p))]
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not alive, f"worker processes left behind: {[(p.pid, _cmdline(p)) for p in alive]}"


def worker_processes_anywhere(marker: str) -> list[psutil.Process]:
    """Every live worker process on the machine whose command line or environment mentions `marker`."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            cmd = " ".join(proc.info["cmdline"] or [])
            if "pipeline_lib.launch.worker" in cmd and marker in cmd and _is_running(proc):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def _is_running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _cmdline(proc: psutil.Process) -> list[str]:
    try:
        return proc.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return []


def model_weights(checkpoint_prefix: str) -> dict[str, np.ndarray]:
    """The model's trainable variables in a checkpoint, by object-graph key (identical across strategies).

    A checkpoint stores each variable once, under the first path that reaches it; for the model's
    weights that is the optimizer's `_trainable_variables` list (or `model/...` when not tracked there).
    """
    import tensorflow as tf

    reader = tf.train.load_checkpoint(checkpoint_prefix)
    return {key: reader.get_tensor(key) for key in sorted(reader.get_variable_to_shape_map())
            if (key.startswith("model/") or "/_trainable_variables/" in key) and "OPTIMIZER_SLOT" not in key}


def max_abs_diff(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    assert sorted(a) == sorted(b), f"different variables: {sorted(set(a) ^ set(b))}"
    assert a, "no model variables found in the checkpoint"
    return max(float(np.max(np.abs(a[k].astype(np.float64) - b[k].astype(np.float64)))) for k in a)


def assert_coordinator_fed_each_example_once(manifest: Manifest, config: PipelineConfig, ids_dir: str,
                                             attempts: list[tuple[int, int, int]], *, epoch_records: int,
                                             batch_size: int) -> None:
    """A parameter-server run's coordinator fed each example of each epoch once, in the global order.

    The coordinator (the chief, input pipeline 0) ships each step's batch of `batch_size` examples, so its records
    of the attempts, each `(num_workers, start_step, end_step)` and cut to the steps it trained, are the elastic
    stream's order (`epochs.elastic_records` from record 0): each whole epoch of `epoch_records` has every example
    once, and the last, partial one none twice.
    """
    import tensorflow as tf

    from pipeline_lib.testing.example_ids import read_record, record_path
    from pipeline_lib.training import epochs

    consumed = [i for workers, start, end in attempts
                for batch in read_record(record_path(ids_dir, 0, workers, start))[:end - start] for i in batch]
    assert len(consumed) == (attempts[-1][2] - attempts[0][1]) * batch_size
    per_epoch = [consumed[start:start + epoch_records] for start in range(0, len(consumed), epoch_records)]
    assert [len(set(epoch)) for epoch in per_epoch] == [len(epoch) for epoch in per_epoch]
    assert all(len(epoch) == epoch_records for epoch in per_epoch[:-1])
    tf.keras.utils.set_random_seed(config.train.seed)
    expected = epochs.elastic_records(manifest, config.train, epoch_records=epoch_records, start_record=0,
                                      global_batch=1, num_workers=1, worker=0, num_steps=len(consumed), with_ids=True)
    assert consumed == [int(i) for i in expected.as_numpy_iterator()]
